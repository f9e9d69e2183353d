"""Mixture-of-experts feed-forward: a router picks top-k experts per token; each expert is a
gated MLP; the token's output is the routing-weighted sum of its experts' outputs (plus, in
DeepSeekMoE, always-on shared experts).

    x ─ router ─ (weights, expert ids) [T, k]
    x ─ tokens sorted by expert ─ per active expert: down(silu(gate(x_e)) * up(x_e)) * w ─ Σ ─ out

The router is openinfer/layers/moe_router.py. Expert weights are stacked at load into one
``[E, 2I, H]`` gate/up and one ``[E, H, I]`` down tensor. The torch path (``forward_native``,
the oracle) groups the step's (token, expert) pairs by expert with one sort and runs one GEMM
pair per expert that has tokens: no Python loop over tokens, no per-expert modules. On the cpu
backend, ``forward_cpu`` runs all of a step's experts in one call of the extension's fused
kernel (openinfer/kernels/fused_moe.py), on weights packed once when the model is bound to the
platform (fp8 checkpoints' experts kept as loaded); ``forward_cuda`` runs Triton's grouped GEMMs
(openinfer/kernels/triton_moe.py); expert parallelism keeps the torch path on CPU (its weights
move between ranks).

Tensor parallel: every rank holds every expert's share of the intermediate features (rows
of gate/up, columns of down), routes all tokens the same way (the router is replicated),
and the experts' partial outputs are summed by one all-reduce.

Expert parallel (``--enable-expert-parallel``): a rank holds whole experts instead, in its
physical slots (``placement``, openinfer.distributed.eplb; with redundant slots a hot expert
has several replicas, and a token goes to replica ``token index mod replicas``). When
attention is tensor parallel every rank sees every token, so dispatch is local: a rank runs
the (token, expert) pairs whose replica it holds, and the same all-reduce combines them.
When attention is data parallel (each rank its own requests) the tokens are all-gathered
first and the outputs reduce-scattered back (``_exchange``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.distributed.eplb import Placement, initial_placement
from openinfer.distributed.parallel_state import get_ep, get_tp
from openinfer.kernels.cpu_attention import bf16_dot
from openinfer.kernels.custom_op import CustomOp, Platform
from openinfer.kernels.fp8_gemm import FP4_GROUP, dequantize, dequantize_fp4
from openinfer.kernels.fused_moe import Fp4Experts, Fp8Experts, PackedExperts, fused_moe, pack_experts
from openinfer.layers.linear import narrow, reads_slices
from openinfer.layers.moe_router import Router, RoutingConfig

logger = logging.getLogger("openinfer.layers.moe")

ALL_TO_ALL_MIN_TOKENS: dict[str, int] = {"cpu": 0, "cuda": 256}
"""Data-parallel expert parallelism, by device type: from this many tokens over all ranks in
a step, tokens travel all-to-all (each only to the ranks holding its experts, and back)
instead of being all-gathered to every rank and reduce-scattered back. Over gloo the
all-to-all took 0.72-1.02x the time from 1 to 512 tokens per rank, never clearly slower
(benchmarks/bench_expert_dispatch.py); the CUDA value is NCCL practice, not yet measured
here. $OPENINFER_EP_ALL_TO_ALL_MIN_TOKENS overrides both."""
if "OPENINFER_EP_ALL_TO_ALL_MIN_TOKENS" in os.environ:
    ALL_TO_ALL_MIN_TOKENS = dict.fromkeys(ALL_TO_ALL_MIN_TOKENS,
                                          int(os.environ["OPENINFER_EP_ALL_TO_ALL_MIN_TOKENS"]))

SMALL_GEMM_ROWS = 16
"""Experts given at most this many rows in a step (decode batches spread over many experts)
run through the CPU extension's few-row float32 GEMM, which streams each expert's weights
about twice as fast as F.linear at 3 rows (benchmarks/bench_moe.py)."""


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``
    with ``g = min(gate, limit)``."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * gate * torch.sigmoid(gate * self.alpha)


@dataclass(frozen=True)
class ClampedSiluAndMul:
    """DeepSeek-V4's expert activation: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""

    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)


class ExpertGemm(CustomOp):
    """y = x @ W^T + b for one expert's rows. ``forward_cpu``: float32 calls of at most
    SMALL_GEMM_ROWS rows (an expert's share of a decode step) run the C++ few-row kernel, which
    streams the weight once; F.linear's MKL call costs more than the product at such sizes."""

    def forward_native(self, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def forward_cpu(self, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32 or x.shape[0] > SMALL_GEMM_ROWS:
            return F.linear(x, weight, bias)
        out = x.new_empty(x.shape[0], weight.shape[0])
        self.cpu_kernels.small_gemm(out, x.contiguous(), weight, bias)
        return out


def _kernel_activation(activation: Callable) -> tuple[str, float, float] | None:
    """The fused CPU kernel's name and (alpha, limit) for ``activation``; None: not one it has."""
    if activation is silu_and_mul:
        return "silu", 0.0, 0.0
    if isinstance(activation, ClampedSiluAndMul):
        return "clamped_silu", 0.0, activation.limit
    if isinstance(activation, ClampedSwiGLU):
        return "clamped_swiglu", activation.alpha, activation.limit
    return None


class FusedExperts(CustomOp):
    """``num_experts`` gated MLPs stored as two stacked tensors (and, with ``bias``, two
    stacked biases). ``forward`` routes, counts and (expert parallel) exchanges tokens; the
    bound path computes this rank's (token, slot) pairs: ``forward_native`` a loop over
    experts, ``forward_cpu`` the fused kernel, ``forward_cuda`` Triton's grouped GEMMs
    (openinfer/kernels/triton_moe.py: static shapes, so decode CUDA graphs capture it)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 bias: bool = False,
                 activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_and_mul,
                 ) -> None:
        super().__init__()
        self.tp = get_tp()
        self.num_experts = num_experts
        self.ep = ep = get_ep()
        self.placement: Placement | None = None
        """Expert parallel: the expert in every rank's every slot; None: all experts here,
        slot e holding expert e."""
        self.num_slots = num_experts
        """Experts this rank holds (its physical slots)."""
        if ep.enabled:
            self.ep_rank, self.num_slots = ep.rank, ep.slots_per_rank(num_experts)
            self.set_placement(initial_placement(num_experts, ep.size, ep.num_redundant))
        else:
            intermediate_size = self.tp.split(intermediate_size, "the experts' intermediate size")
        self.intermediate_size = intermediate_size
        """This rank's share (all of it under expert parallelism)."""
        self.activation = activation
        self.gemm = ExpertGemm()
        self.w13 = nn.Parameter(torch.empty(self.num_slots, 2 * intermediate_size, hidden_size),
                                requires_grad=False)
        """Each expert's gate rows then its up rows."""
        self.w2 = nn.Parameter(torch.empty(self.num_slots, hidden_size, intermediate_size),
                               requires_grad=False)
        self.w13.weight_loader = self._load_w13
        self.w2.weight_loader = self._load_w2
        self.b13 = self.b2 = None
        if bias:
            self.b13 = nn.Parameter(torch.zeros(self.num_slots, 2 * intermediate_size),
                                    requires_grad=False)
            self.b2 = nn.Parameter(torch.zeros(self.num_slots, hidden_size), requires_grad=False)
        self.token_counts: torch.Tensor | None = None
        """Tokens routed to each expert so far (int64 [E], a running total); None while
        counting is off (``count_tokens``)."""
        self.packed: PackedExperts | None = None
        """``forward_cpu``'s weights (the plain ones are freed once packed)."""
        self.fp8_block: tuple[int, int] | None = None
        """Set by ``keep_fp8``: w13 and w2 are the checkpoint's float8_e4m3fn, with
        ``w13_scale_inv`` and ``w2_scale_inv`` per tile of this many rows x columns."""
        self.fp4 = False
        """Set by ``keep_fp4``: w13 and w2 are MXFP4 bytes [slots, 2I, H / 2], [slots, H, I / 2],
        with float32 scales per 32 inputs of each row (``w13_scale_inv``, ``w2_scale_inv``)."""

    def keep_fp8(self, block: tuple[int, int]) -> bool:
        """Before loading: hold the experts as the checkpoint's block-scaled fp8 (one byte per
        weight), which the fused CPU kernel reads as they are. False, and nothing changed, under
        expert parallelism (whose weights move between ranks) or where a tensor-parallel rank's
        share of the intermediate features does not start on a tile."""
        rows, cols = block
        first = self.tp.rank * self.intermediate_size
        if self.ep.enabled or first % rows or first % cols or rows % 16:
            return False
        self.dense_dtype = self.w13.dtype
        slots, two_i, hidden = self.w13.shape
        inter = two_i // 2
        for name, loader in (("w13", self._load_w13), ("w2", self._load_w2)):
            weight = nn.Parameter(torch.empty_like(getattr(self, name), dtype=torch.float8_e4m3fn),
                                  requires_grad=False)
            weight.weight_loader = loader
            setattr(self, name, weight)
        self.w13_scale_inv = nn.Parameter(
            torch.empty(slots, 2, -(-inter // rows), -(-hidden // cols)), requires_grad=False)
        self.w13_scale_inv.weight_loader = self._load_w13_scale
        self.w2_scale_inv = nn.Parameter(
            torch.empty(slots, -(-hidden // rows), -(-inter // cols)), requires_grad=False)
        self.w2_scale_inv.weight_loader = self._load_w2_scale
        self.fp8_block = block
        return True

    def keep_fp4(self) -> bool:
        """Before loading: hold MXFP4 experts (DeepSeek-V4's release) as the checkpoint's bytes,
        two weights each, and a power-of-two scale per 32 inputs of a row, which the fused CPU
        kernel reads as they are. False, and nothing changed, under expert parallelism or
        where a tensor-parallel rank's share is no whole number of runs of 32 inputs."""
        if self.ep.enabled or self.intermediate_size % FP4_GROUP or self.w13.shape[2] % FP4_GROUP:
            return False
        self.dense_dtype = self.w13.dtype
        slots, two_i, hidden = self.w13.shape
        inter = two_i // 2
        shapes = {"w13": (slots, two_i, hidden // 2), "w2": (slots, hidden, inter // 2),
                  "w13_scale_inv": (slots, two_i, hidden // FP4_GROUP),
                  "w2_scale_inv": (slots, hidden, inter // FP4_GROUP)}
        loaders = {"w13": self._load_w13, "w2": self._load_w2_fp4, "w13_scale_inv": self._load_w13,
                   "w2_scale_inv": self._load_w2_fp4}
        for name, shape in shapes.items():
            dtype = torch.uint8 if name in ("w13", "w2") else torch.float32
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = loaders[name]
            setattr(self, name, param)
        self.fp4 = True
        return True

    @reads_slices
    def _load_w2_fp4(self, param: torch.Tensor, tensor: torch.Tensor, shard: tuple[int, int]) -> None:
        """w2's bytes (two inputs each) or its scales (one per 32 inputs): this rank's columns."""
        per_column = self.intermediate_size // param.shape[2]
        for slot in self.local_slots(shard[0]):
            part = narrow(tensor, 1, self._first_row // per_column, param.shape[2])
            param[slot].copy_(part.view(torch.uint8) if part.dtype == torch.int8 else part)

    def bind(self, platform: Platform) -> None:
        """On the cpu backend, the fused kernel where it computes these experts (not under
        expert parallelism; float32 or bfloat16 with an even hidden size, or fp8 weights; an
        activation it has): their weights are packed here, once. FP8 experts any other path
        computes are multiplied out here."""
        super().bind(platform)
        if self.packed is not None:
            return
        kernel_activation = _kernel_activation(self.activation)
        quantized = self.fp8_block is not None or self.fp4
        dtype, hidden = self.dense_dtype if quantized else self.w13.dtype, self.w2.shape[1]
        if self.forward_path == "forward_cpu" and (
                self.ep.enabled or kernel_activation is None or dtype not in (torch.float32, torch.bfloat16)
                or (dtype == torch.bfloat16 and hidden % 2 and not quantized)):
            self._forward_path = self.forward_native
        if self.forward_path == "forward_cuda" and importlib.util.find_spec("triton") is None:
            self._forward_path = self.forward_native
        if self.forward_path != "forward_cpu":
            if quantized:
                logger.info("%s experts multiplied out to %s: the %s path reads dense weights",
                            "MXFP4" if self.fp4 else "fp8", dtype, self.forward_path)
                self._dequantize_fp8()
            return
        fp8 = (Fp8Experts(self.w13_scale_inv, self.w2_scale_inv, self.fp8_block)
               if self.fp8_block else None)
        fp4 = Fp4Experts(self.w13_scale_inv, self.w2_scale_inv) if self.fp4 else None
        with torch.no_grad():
            self.packed = pack_experts(self.w13, self.w2, self.b13, self.b2,
                                       self.cpu_kernels.fused_moe_tile(), *kernel_activation,
                                       fp8=fp8, fp4=fp4)
        for name in ("w13", "w2", "b13", "b2", "w13_scale_inv", "w2_scale_inv"):  # nothing reads them now
            if getattr(self, name, None) is not None:
                setattr(self, name, nn.Parameter(torch.empty_like(getattr(self, name), device="meta"),
                                                 requires_grad=False))

    def _dense_expert(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's w13 and w2 in the model's dtype (fp8 or MXFP4 ones multiplied out)."""
        if self.fp4:
            return (dequantize_fp4(self.w13[slot], self.w13_scale_inv[slot]).to(self.dense_dtype),
                    dequantize_fp4(self.w2[slot], self.w2_scale_inv[slot]).to(self.dense_dtype))
        if not self.fp8_block:
            return self.w13[slot], self.w2[slot]
        block, dtype, inter = self.fp8_block, self.dense_dtype, self.intermediate_size
        w13 = torch.cat([dequantize(self.w13[slot, p * inter:(p + 1) * inter], self.w13_scale_inv[slot, p],
                                    block, dtype) for p in (0, 1)])
        return w13, dequantize(self.w2[slot], self.w2_scale_inv[slot], block, dtype)

    def _dequantize_fp8(self) -> None:
        """w13 and w2 as dense ``dense_dtype`` weights, their scales dropped."""
        with torch.no_grad():
            w13, w2 = zip(*(self._dense_expert(slot) for slot in range(self.num_slots)))
        self.w13 = nn.Parameter(torch.stack(w13), requires_grad=False)
        self.w2 = nn.Parameter(torch.stack(w2), requires_grad=False)
        del self.w13_scale_inv, self.w2_scale_inv
        self.fp8_block, self.fp4 = None, False

    def set_placement(self, placement: Placement) -> None:
        """Expert parallel: which expert each slot holds from now on (the caller moves the
        weights), and the lookup tables the forward pass routes by."""
        self.placement = placement
        self.first_slot = self.ep_rank * self.num_slots
        replicas = placement.replicas()
        width = max(len(r) for r in replicas)
        self._replica_slots = torch.tensor([r + r[:1] * (width - len(r)) for r in replicas])
        self._replica_counts = torch.tensor([len(r) for r in replicas])

    def local_slots(self, expert: int) -> list[int]:
        """This rank's slots that hold ``expert``."""
        if self.placement is None:
            return [expert]
        mine = self.placement.rank_experts(self.ep_rank)
        return [slot for slot, e in enumerate(mine) if e == expert]

    def count_tokens(self, enabled: bool = True) -> None:
        self.token_counts = torch.zeros(self.num_experts, dtype=torch.int64) if enabled else None

    @reads_slices
    def _load_w13(self, param: torch.Tensor, tensor: torch.Tensor, shard: tuple[int, int]) -> None:
        expert, part = shard  # part 0: gate, 1: up
        n = self.intermediate_size
        for slot in self.local_slots(expert):  # none: another rank's expert, never read
            param[slot, part * n:(part + 1) * n].copy_(narrow(tensor, 0, self._first_row, n))

    @reads_slices
    def _load_w2(self, param: torch.Tensor, tensor: torch.Tensor, shard: tuple[int, int]) -> None:
        n = self.intermediate_size
        for slot in self.local_slots(shard[0]):
            param[slot].copy_(narrow(tensor, 1, self._first_row, n))

    @reads_slices
    def _load_w13_scale(self, param: torch.Tensor, tensor: torch.Tensor, shard: tuple[int, int]) -> None:
        expert, part = shard
        tiles = param.shape[2]
        for slot in self.local_slots(expert):
            param[slot, part].copy_(narrow(tensor, 0, self._first_row // self.fp8_block[0], tiles))

    @reads_slices
    def _load_w2_scale(self, param: torch.Tensor, tensor: torch.Tensor, shard: tuple[int, int]) -> None:
        tiles = param.shape[2]
        for slot in self.local_slots(shard[0]):
            param[slot].copy_(narrow(tensor, 1, self._first_row // self.fp8_block[1], tiles))

    @property
    def _first_row(self) -> int:
        """Where this rank's intermediate features start in a checkpoint expert."""
        return 0 if self.placement is not None else self.tp.rank * self.intermediate_size

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights/ids [T, k] -> [T, H]."""
        if self.token_counts is not None:
            self.token_counts += torch.bincount(ids.flatten(), minlength=self.num_experts).cpu()
        if self.ep.across_data_parallel:
            return self._exchange(x, weights, ids)
        return self.tp.all_reduce(self._run_experts(x, weights, ids))

    def _run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share of the output: every (token, expert) pair whose
        expert (or replica) it holds, weighted, summed per token."""
        slots = ids if self.placement is None else self._route_to_slots(ids)
        return self._run_slots(x, weights, slots)

    def _run_slots(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``_run_experts`` for pairs already mapped to this rank's slots (``num_slots``:
        not here)."""
        return self._forward_path(x, weights, slots)

    def forward_cpu(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return fused_moe(self.cpu_kernels, self.packed, x, weights, slots, bf16_dot())

    def forward_cuda(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        from openinfer.kernels import triton_moe  # (triton: an optional dependency)

        return triton_moe.fused_experts(x, self.w13, self.w2, self.b13, self.b2, weights, slots,
                                        self.activation)

    def forward_native(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        top_k = slots.shape[1]
        flat = slots.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert slot
        # The last bin: pairs whose expert another rank holds (expert parallel).
        counts = torch.bincount(flat, minlength=self.num_slots + 1)
        tokens = order // top_k
        pair_weights = weights.flatten()[order].to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for slot, n in enumerate(counts[:self.num_slots].tolist()):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            b13, b2 = (None, None) if self.b13 is None else (self.b13[slot], self.b2[slot])
            w13, w2 = self._dense_expert(slot)
            gate, up = self.gemm(x[rows], w13, b13).chunk(2, dim=-1)
            y = self.gemm(self.activation(gate, up), w2, b2)
            out.index_add_(0, rows, y * pair_weights[start:start + n, None])
            start += n
        return out

    def _exchange(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Data-parallel ranks: gather every rank's tokens (padded to the largest count),
        run this rank's experts on all of them, and reduce-scatter the sums back, so each
        rank gets its own tokens' outputs. A rank without tokens (T = 0, k = 0) still
        joins, for the others' tokens its experts take."""
        ep = self.ep
        shape = ep.all_gather_rows(torch.tensor([[x.shape[0], ids.shape[1]]], device=x.device))
        counts, top_k = shape[:, 0].tolist(), int(shape[:, 1].max())
        most = max(counts)
        if most == 0:
            return x
        if sum(counts) >= ALL_TO_ALL_MIN_TOKENS.get(x.device.type, 0):
            return self._all_to_all(x, weights, ids, top_k)
        T = x.shape[0]
        padded_x = x.new_zeros(most, x.shape[1])
        padded_ids = ids.new_zeros(most, top_k)
        padded_w = weights.new_zeros(most, top_k)
        if T:
            padded_x[:T], padded_ids[:T], padded_w[:T] = x, ids, weights
        rows = torch.cat([torch.arange(r * most, r * most + n, device=x.device)
                          for r, n in enumerate(counts)])
        all_x = ep.all_gather_rows(padded_x)[rows]
        all_ids = ep.all_gather_rows(padded_ids)[rows]
        all_w = ep.all_gather_rows(padded_w)[rows]
        partial = x.new_zeros(ep.size * most, x.shape[1])
        partial[rows] = self._run_experts(all_x, all_w, all_ids)
        return ep.reduce_scatter_rows(partial)[:T]

    def _all_to_all(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    top_k: int) -> torch.Tensor:
        """Data-parallel ranks, larger batches: each token goes once to every rank that
        holds one of its experts' chosen replicas (with that rank's slots and weights for
        it), the ranks run what they received, and the outputs come back the same way and
        are summed per token. Four all-to-alls (counts, rows, slots and weights packed,
        outputs) against the all-gather's every-token-everywhere."""
        ep, S = self.ep, self.num_slots
        T = x.shape[0]
        if T:
            physical = self._physical_slots(ids)  # [T, k]
            rank_of = physical // S
            local = physical - rank_of * S
        else:  # nothing to send, but the collectives are joined all the same
            rank_of = local = ids.new_zeros(0, top_k)
            weights = weights.new_zeros(0, top_k)
        tokens, slots, pair_w, send = [], [], [], []
        for r in range(ep.size):
            mine = rank_of == r
            t = mine.any(dim=1).nonzero().flatten()
            tokens.append(t)
            slots.append(torch.where(mine[t], local[t], S))
            pair_w.append(torch.where(mine[t], weights[t].float(), 0.0))
            send.append(t.numel())
        send_counts = torch.tensor(send, device=x.device)
        recv_counts = torch.empty_like(send_counts)
        ep.all_to_all(recv_counts, send_counts)
        recv = recv_counts.tolist()
        order = torch.cat(tokens)
        rows = ep.all_to_all(x.new_empty(sum(recv), x.shape[1]), x[order], recv, send)
        # slots and weights in one float64 message (slot ids are small integers)
        meta = torch.cat([torch.cat(slots).double(), torch.cat(pair_w).double()], dim=1)
        meta = ep.all_to_all(meta.new_empty(sum(recv), 2 * top_k), meta, recv, send)
        got_slots, got_w = meta[:, :top_k].long(), meta[:, top_k:].float()
        y = self._run_slots(rows, got_w, got_slots)
        back = ep.all_to_all(x.new_empty(order.numel(), x.shape[1]), y, send, recv)
        return torch.zeros_like(x).index_add_(0, order, back)

    def _physical_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Expert ids [T, k] -> the physical slot (any rank) of the replica each pair uses."""
        if self._replica_slots.device != ids.device:
            self._replica_slots = self._replica_slots.to(ids.device)
            self._replica_counts = self._replica_counts.to(ids.device)
        token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        return self._replica_slots[ids, token % self._replica_counts[ids]]

    def _route_to_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Expert ids [T, k] -> this rank's slot for each pair, or ``num_slots`` where another
        rank's replica takes it (token t goes to replica t mod replicas)."""
        local = self._physical_slots(ids) - self.first_slot
        return local.masked_fill_((local < 0) | (local >= self.num_slots), self.num_slots)


class MoE(nn.Module):
    """Router + routed experts (+ shared experts, a plain gated MLP every token goes through)."""

    def __init__(self, hidden_size: int, intermediate_size: int, routing: RoutingConfig,
                 shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = Router(hidden_size, routing)
        self.experts = FusedExperts(routing.num_experts, hidden_size, intermediate_size)
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
