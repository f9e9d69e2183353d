"""DeepSeek-V4: every layer attends over a sliding window of recent tokens, and most layers
also over a compressed view of everything older; the residual stream is ``hc_mult`` streams
mixed by hyper-connections (openinfer.layers.hyper_connections); every feed-forward is a
mixture of experts.

    streams ─ mHC ─> x ─ norm ─ Attention ─ mHC write-back ─ mHC ─> x ─ norm ─ MoE ─ write-back ─ ...
    ... ─ hyper head ─ norm ─ LM head

Attention (one shared key/value head of ``head_dim``, K = V, partial interleaved RoPE on its
last ``rope_dim`` dims; q through a low-rank ``q_a``/``q_b`` with an unweighted per-head norm):

* ``sliding_attention``: keys ``t - W + 1 .. t``.
* ``heavily_compressed_attention`` (HCA, ratio m = 128): plus one entry per complete group of m
  tokens, a per-channel softmax-gated sum of their projections (normed, roped at the group's
  first position); query t sees entry w iff ``w < (t + 1) // m``.
* ``compressed_sparse_attention`` (CSA, m = 4): entries pool overlapping groups (the second
  half of group w and the first half of group w - 1), and a lightning indexer (its own
  compressed keys, ``index_n_heads`` ReLU scores weighted per head) picks each query's top
  ``index_topk`` entries.

One softmax covers window keys, entries and a per-head sink logit; the output is rotated back
at the query's position and projected by ``o_groups`` low-rank groups. MoE: ``sqrt(softplus)``
scores, experts picked by score + bias (or by token id through ``tid2eid`` in hash layers),
weights renormalised and scaled, SwiGLU with clamped inputs in routed and shared experts.

State in the engine: each attention layer owns several KV cache *slots* (``kv_cache_specs``
lists them, in layer order): the window K (sliding-window pages, K = V), and for compressed
layers the compressor's raw projections (sliding-window pages over the last m or 2m tokens:
what pooling the next entries needs), the entries (``CompressedSpec`` pages), and for CSA the
indexer's raw projections and keys likewise. So prefix caching, hit resumption behind window
snapshots and preemption work as for any layer. Attention over a step runs in torch through
openinfer/attention/compressed.py (the page arithmetic and the sink softmax; no fused kernel yet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.attention import compressed
from openinfer.attention.base import AttentionMetadata
from openinfer.distributed.parallel_state import get_tp
from openinfer.kernels.paged_attention import write_kv
from openinfer.kv.spec import CompressedSpec, KVSpec, SlidingWindowSpec
from openinfer.layers.embedding import LMHead, VocabEmbedding
from openinfer.layers.hyper_connections import HyperConnection, HyperHead, unweighted_rms_norm
from openinfer.layers.linear import (
    ColumnParallelLinear,
    Linear,
    RowParallelLinear,
    default_weight_loader,
    narrow,
    reads_slices,
)
from openinfer.layers.mlp import GatedMLP
from openinfer.layers.moe import ClampedSiluAndMul, FusedExperts
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import _default_inv_freq, _yarn_params
from openinfer.models.arch import CSA, HCA, SLIDING, ArchConfig, V4Arch
from openinfer.models.base import CausalLM


class V4Rope:
    """Interleaved RoPE on the last ``rope_dim`` dims of each vector; cos/sin are rounded to
    the compute dtype before use, the rotation computed in float32 (as the reference)."""

    def __init__(self, rope_dim: int, theta: float, scaling: dict | None, max_position: int) -> None:
        if scaling and (scaling.get("rope_type") or scaling.get("type")) == "yarn":
            # V4 keeps the YaRN frequencies but not its attention factor.
            self.inv_freq, _ = _yarn_params(rope_dim, theta, scaling, max_position)
        else:
            self.inv_freq = _default_inv_freq(rope_dim, theta)
        self.rope_dim = rope_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, ..., D] with cos/sin [N, rope_dim / 2] (broadcast over the middle dims)."""
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
        c = cos.repeat_interleave(2, -1).view(shape).float()
        s = sin.repeat_interleave(2, -1).view(shape).float()
        rd = self.rope_dim
        r = x[..., -rd:].float()
        rot = torch.stack((-r[..., 1::2], r[..., 0::2]), -1).flatten(-2)
        return torch.cat([x[..., :-rd], (r * c + rot * s).to(x.dtype)], -1)


def _fp32_param(*shape: int, fill: float = 0.0) -> nn.Parameter:
    return nn.Parameter(torch.full(shape, fill, dtype=torch.float32), requires_grad=False)


def _rank_rows(rank: int):
    """A loader of rank ``rank``'s block of rows (as many as the parameter has)."""

    @reads_slices
    def load(param: nn.Parameter, loaded) -> None:
        default_weight_loader(param, narrow(loaded, 0, rank * param.shape[0], param.shape[0]))

    return load


class Compressor(nn.Module):
    """Pools each complete group of ``ratio`` tokens into one entry: a per-channel softmax over
    the group of ``gate + position_bias`` weights the tokens' projections; the sum is normed
    and roped at the group's first position. ``overlap`` (CSA and its indexer): an entry pools
    the second half (``Cb``) of its own group and the first half (``Ca``) of the previous one."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap, self.width = dim, ratio, overlap, width
        self.wkv = Linear(hidden, width)
        self.wgate = Linear(hidden, width)
        self.ape = _fp32_param(ratio, width)
        """Per-offset gate bias ("absolute position embedding" of a token within its group)."""
        self.norm = RMSNorm(dim, eps, fp32_weight=True)

    def pool(self, group: tuple[torch.Tensor, torch.Tensor],
             previous: tuple[torch.Tensor, torch.Tensor] | None, has_previous: torch.Tensor,
             positions: torch.Tensor, rope: V4Rope) -> torch.Tensor:
        """Entries from their groups' raw rows: ``group`` (kv, gate) [E, ratio, width] of each
        entry's own tokens; with overlap, ``previous`` those of the group before it, absent
        where ``has_previous`` [E] is False (entry 0). Roped at ``positions`` [E]: [E, dim]."""
        d = self.dim
        kv, gate = group
        gate = gate + self.ape  # (float32)
        if self.overlap:
            kv_before, gate_before = previous
            gate_before = (gate_before[..., :d] + self.ape[:, :d]).masked_fill(
                ~has_previous[:, None, None], float("-inf"))
            kv = torch.cat([kv_before[..., :d], kv[..., d:]], 1)
            gate = torch.cat([gate_before, gate[..., d:]], 1)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(1)
        pooled = self.norm(pooled)
        return rope(pooled, *rope.cos_sin(positions, pooled.dtype))


class Indexer(nn.Module):
    """CSA's lightning indexer: its own compressed keys (a compressor at ``index_head_dim``),
    and per query ``index_n_heads`` scores ``relu(q_h . k)`` weighted per head; each query
    keeps the entries of its top ``index_topk`` scores."""

    def __init__(self, arch: ArchConfig, v4: V4Arch, ratio: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk = v4.index_heads, v4.index_head_dim, v4.index_topk
        self.compressor = Compressor(arch.hidden_size, self.head_dim, ratio, True, arch.rms_norm_eps)
        self.wq_b = Linear(v4.q_lora_rank, self.num_heads * self.head_dim)
        self.weights_proj = Linear(arch.hidden_size, self.num_heads)


class SinkAttention(nn.Module):
    """DeepSeek-V4's and V4.1's attention projections: queries through a low-rank ``wq_a`` /
    ``q_norm`` / ``wq_b`` (this rank's heads), the one K = V head's ``wkv``, per-head sink
    logits, and the output rotated back at the query's position and projected by ``o_groups``
    low-rank groups (``wo_a``, each over a contiguous run of heads; ``wo_b``). Under tensor
    parallelism a rank holds its share of the query heads (``wq_b``'s rows, their sinks) and of
    the output groups (``wo_a``'s rows and ``wo_b``'s columns, summed by ``wo_b``'s all-reduce);
    the one key/value head is whole on every rank."""

    def __init__(self, arch: ArchConfig, q_lora_rank: int, o_groups: int, o_lora_rank: int,
                 rope: V4Rope) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        tp = get_tp()
        self.num_heads = tp.split(arch.num_heads, "num_attention_heads")  # this rank's
        self.head_dim = arch.head_dim
        self.rope = rope
        self.wq_a = Linear(hidden, q_lora_rank)
        self.q_norm = RMSNorm(q_lora_rank, eps, fp32_weight=True)
        self.wq_b = ColumnParallelLinear(q_lora_rank, arch.num_heads * self.head_dim,
                                         what="num_attention_heads x head_dim")
        self.wkv = Linear(hidden, self.head_dim)
        self.groups, self.group_rank = tp.split(o_groups, "o_groups"), o_lora_rank
        self.wo_a = nn.Module()  # grouped: [groups * rank, heads * head_dim / groups]
        self.wo_a.weight = nn.Parameter(
            torch.empty(self.groups * self.group_rank, self.num_heads * self.head_dim // self.groups),
            requires_grad=False)
        self.wo_a.weight.weight_loader = _rank_rows(tp.rank)
        self.wo_b = RowParallelLinear(o_groups * self.group_rank, hidden)
        self.attn_sink = _fp32_param(self.num_heads)
        self.attn_sink.weight_loader = _rank_rows(tp.rank)

    def project_out(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The heads' results [T, H, D] rotated back, then through the output groups: [T, hidden]."""
        out = self.rope(out, cos, -sin).view(out.shape[0], self.groups, -1)
        wa = self.wo_a.weight.view(self.groups, self.group_rank, -1)
        return self.wo_b(torch.einsum("tgi,gri->tgr", out, wa).flatten(1))


class V4Attention(SinkAttention):
    """The compressors and the indexer are shared by all heads, so every rank computes and
    caches them whole (as MLA's latent)."""

    def __init__(self, arch: ArchConfig, v4: V4Arch, layer: int, ropes: dict[str, V4Rope]) -> None:
        self.kind = v4.layer_types[layer]
        super().__init__(arch, v4.q_lora_rank, v4.o_groups, v4.o_lora_rank,
                         ropes["main" if self.kind == SLIDING else "compress"])
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.window = v4.window
        self.eps = eps
        self.norm = RMSNorm(self.head_dim, eps, fp32_weight=True)
        self.ratio = 0
        if self.kind != SLIDING:
            self.ratio = v4.compress_rates[self.kind]
            self.compressor = Compressor(hidden, self.head_dim, self.ratio, self.kind == CSA, eps)
            if self.kind == CSA:
                self.indexer = Indexer(arch, v4, self.ratio)

    # ---- the layer's KV slots ------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return {SLIDING: 1, HCA: 3, CSA: 5}[self.kind]

    def kv_specs(self, block_size: int, dtype: str) -> list[KVSpec]:
        """Window K; then, compressed layers: raw compressor rows (the last m or 2m tokens'
        projections) and entries; CSA: the indexer's raw rows and keys."""
        specs: list[KVSpec] = [SlidingWindowSpec(block_size, 1, self.head_dim, dtype, self.window,
                                                 shared_kv=True)]
        if self.kind != SLIDING:
            m, c = self.ratio, self.compressor
            span = 2 * m if c.overlap else m
            specs += [SlidingWindowSpec(block_size, 1, c.width, dtype, span),
                      CompressedSpec(block_size, m, self.head_dim, dtype)]
            if self.kind == CSA:
                ix = self.indexer.compressor
                specs += [SlidingWindowSpec(block_size, 1, ix.width, dtype, 2 * m),
                          CompressedSpec(block_size, m, ix.dim, dtype)]
        return specs

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, positions: torch.Tensor, x: torch.Tensor, caches: list[torch.Tensor],
                metas: list[AttentionMetadata]) -> torch.Tensor:
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        qr = self.q_norm(self.wq_a(x))
        q = self.rope(unweighted_rms_norm(self.wq_b(qr).view(T, H, D), self.eps), cos, sin)
        kv = self.rope(self.norm(self.wkv(x)), cos, sin)
        write_kv(caches[0], kv[:, None], kv[:, None], metas[0].slot_mapping)
        if self.kind != SLIDING:
            self._write_raw(self.compressor, x, caches[1], metas[1])
            if self.kind == CSA:
                self._write_raw(self.indexer.compressor, x, caches[3], metas[3])
            self._pool_new(self.compressor, caches[1:3], metas[1:3])
            if self.kind == CSA:
                self._pool_new(self.indexer.compressor, caches[3:5], metas[3:5])
        out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
        for batch in compressed.step_batches(metas[0]):  # the decodes; groups of prefill chunks
            rows = batch.rows
            got = self._attend(batch, q[rows], qr[rows], x[rows], caches, metas)
            out.index_copy_(0, batch.to_rows, got.flatten(0, 1).index_select(0, batch.take))
        return self.project_out(out, cos, sin)

    @staticmethod
    def _write_raw(pooler: Compressor, x: torch.Tensor, cache: torch.Tensor,
                   meta: AttentionMetadata) -> None:
        """The step's raw projections (gate without its position bias) into their pages."""
        kv, gate = pooler.wkv(x), pooler.wgate(x)
        write_kv(cache, kv[:, None], gate[:, None], meta.slot_mapping)

    def _pool_new(self, pooler: Compressor, caches: list[torch.Tensor],
                  metas: list[AttentionMetadata]) -> None:
        """Pool every sequence's entries whose groups complete in this step from the raw rows
        (this step's included) and store them in their pages."""
        new = compressed.new_entries(metas[1], pooler.ratio, metas[0])
        if new is None:
            return
        raw_cache, entry_cache = caches

        def rows(at: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            return raw_cache[0][at[0], at[1], 0], raw_cache[1][at[0], at[1], 0]

        entries = pooler.pool(rows(new.group), rows(new.previous) if pooler.overlap else None,
                              new.has_previous, new.positions, self.rope)
        entry_cache[new.slot] = entries.to(entry_cache.dtype)

    def _attend(self, batch: compressed.SequenceBatch, q: torch.Tensor, qr: torch.Tensor,
                x: torch.Tensor, caches: list[torch.Tensor],
                metas: list[AttentionMetadata]) -> torch.Tensor:
        """A batch's queries ([P, N, ...]) over their window keys, their visible (CSA:
        selected) entries and the sinks: [P, N, H, D]."""
        keys, allowed = compressed.batch_window(caches[0], metas[0], batch, self.window)
        if self.kind != SLIDING:
            found = compressed.batch_entries(caches[2], metas[2], batch, self.ratio)
            if found is not None:
                entries, visible = found
                if self.kind == CSA:
                    index_keys, _ = compressed.batch_entries(caches[4], metas[4], batch, self.ratio)
                    visible = self._select(qr, x, batch.positions, index_keys, visible)
                keys = torch.cat([keys, entries], 1)
                allowed = torch.cat([allowed, visible], 2)
        return compressed.attend_with_sinks(q, keys, allowed, self.attn_sink, self.head_dim**-0.5)

    def _select(self, qr: torch.Tensor, x: torch.Tensor, t: torch.Tensor, index_keys: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """CSA: the entries each query's indexer scores put in its top ``index_topk``. A batch:
        qr, x [P, N, ...], positions t [P, N], index keys [P, C, DI], visible [P, N, C]."""
        ix = self.indexer
        (P, N), heads = t.shape, ix.num_heads
        qi = self.rope(ix.wq_b(qr.flatten(0, 1)).view(P * N, heads, ix.head_dim),
                       *self.rope.cos_sin(t.flatten(), qr.dtype)).view(P, N, heads, ix.head_dim)
        scores = F.relu(torch.einsum("pnhd,pld->pnhl", qi.float(), index_keys.float()))
        scores = scores * ix.head_dim**-0.5
        weights = ix.weights_proj(x.flatten(0, 1)).float().view(P, N, heads, 1) * heads**-0.5
        score = (scores * weights).sum(2).masked_fill(~visible, float("-inf"))
        # ReLU scores tie at 0 often: ties go to the earlier entry (a stable sort), so the choice
        # never depends on how many entries the step scores (its chunking, a prefix hit).
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices
        top = order[..., :min(ix.topk, score.shape[-1])]
        return torch.zeros_like(visible).scatter_(-1, top, True) & visible


class V4MoE(nn.Module):
    """``sqrt(softplus)`` routing over ``E`` experts (picked by score + bias, or by token id in
    hash layers), renormalised weights times ``routed_scaling_factor``; clamped SwiGLU experts
    and one shared expert."""

    def __init__(self, arch: ArchConfig, scaling: float, limit: float, hashed: bool = False,
                 shared_experts: int = 1, vision_bias: bool = False) -> None:
        """``shared_experts``: the shared MLP is that many experts wide (V4.1 reads
        ``n_shared_experts``; V4, as transformers, always one). ``vision_bias``: a second
        expert-score bias for image tokens (V4.1's ``gate.bias_vl``; loaded, unused: no image
        reaches a model here)."""
        super().__init__()
        hidden, inter = arch.hidden_size, arch.moe.intermediate_size
        experts, self.top_k = arch.moe.num_experts, arch.moe.top_k
        self.scaling = scaling
        self.hashed = hashed
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)
        if hashed:
            self.gate.tid2eid = nn.Parameter(torch.zeros(arch.vocab_size, self.top_k, dtype=torch.long),
                                             requires_grad=False)
        else:
            self.gate.bias = _fp32_param(experts)  # the expert-score correction: choice only
        if vision_bias:
            self.gate.bias_vl = _fp32_param(experts)
        self.experts = FusedExperts(experts, hidden, inter, activation=ClampedSiluAndMul(limit))
        self.shared_experts = GatedMLP(hidden, inter * shared_experts, clamp_limit=limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        scores = F.softplus(F.linear(x, self.gate.weight)).sqrt()
        if self.hashed:
            ids = self.gate.tid2eid[input_ids]
        else:
            biased = scores.float() + self.gate.bias
            ids = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scaling
        return self.experts(x, weights, ids) + self.shared_experts(x)


class V4DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, v4: V4Arch, layer: int, ropes: dict[str, V4Rope]) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        streams, iters, hc_eps = v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps
        self.hc_attn = HyperConnection(streams, hidden, iters, hc_eps, eps)
        self.attn_norm = RMSNorm(hidden, eps, fp32_weight=True)
        self.attn = V4Attention(arch, v4, layer, ropes)
        self.hc_ffn = HyperConnection(streams, hidden, iters, hc_eps, eps)
        self.ffn_norm = RMSNorm(hidden, eps, fp32_weight=True)
        self.ffn = V4MoE(arch, v4.routed_scaling_factor, v4.swiglu_limit,
                         hashed=v4.mlp_layer_types[layer] == "hash_moe")

    def forward(self, positions: torch.Tensor, h: torch.Tensor, input_ids: torch.Tensor,
                caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        post, comb, x = self.hc_attn(h)
        y = self.attn(positions, self.attn_norm(x), caches, metas)
        h = HyperConnection.write_back(h, post, comb, y)
        post, comb, x = self.hc_ffn(h)
        y = self.ffn(self.ffn_norm(x), input_ids)
        return HyperConnection.write_back(h, post, comb, y)


class DeepseekV4Model(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        v4 = arch.deepseek_v4()
        hidden, eps, max_position = arch.hidden_size, arch.rms_norm_eps, arch.rope.max_position
        ropes = {
            "main": V4Rope(v4.rope_dim, v4.main_rope_theta, None, max_position),
            "compress": V4Rope(v4.rope_dim, v4.compress_rope_theta, v4.compress_rope, max_position),
        }
        self.streams = v4.hc_mult
        self.embed_tokens = VocabEmbedding(arch.vocab_size, hidden)
        self.layers = nn.ModuleList(V4DecoderLayer(arch, v4, i, ropes) for i in range(arch.num_layers))
        self.hc_head = HyperHead(self.streams, hidden, v4.hc_eps, eps)
        self.norm = RMSNorm(hidden, eps, fp32_weight=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        h = x.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        slot = 0
        for layer in self.layers:
            n = layer.attn.num_slots
            h = layer(positions, h, input_ids, kv_caches[slot:slot + n], metas[slot:slot + n])
            slot += n
        return self.norm(self.hc_head(h))


class DeepseekV4ForCausalLM(CausalLM):
    """Module names follow DeepSeek's checkpoint (``attn.wq_a``, ``ffn.experts.<e>.w1``,
    ``hc_attn_fn``, ``head``: what transformers writes and the Hub holds)."""

    supports_tensor_parallel = True
    supports_decode_graphs = False  # its batches are made from the step's lengths on the host
    supports_fp8_kv_cache = False  # the compressed and indexer caches are read in torch, unscaled

    # Per-expert w1 (gate) / w3 (up) / w2 (down) into the stacked expert tensors; the
    # shared expert's w1/w3 into its merged gate/up projection, w2 as its down projection.
    expert_weights = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}
    packed_modules = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1)}
    checkpoint_renames = {
        "shared_experts.w2": "shared_experts.down_proj",
        **{f"hc_{part}_{p}": f"hc_{part}.{p}" for part in ("attn", "ffn") for p in ("fn", "base", "scale")},
    }

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.model = DeepseekV4Model(arch)
        self.head = LMHead(arch.vocab_size, arch.hidden_size, None)

    def kv_cache_specs(self, block_size: int, dtype: str) -> list[KVSpec | None]:
        """The KV cache slots of every layer, in layer order (see the module docstring)."""
        return [spec for layer in self.model.layers
                for spec in layer.attn.kv_specs(block_size, dtype)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        """Hidden states of the step's tokens; ``kv_caches`` and ``metas`` are per cache slot."""
        return self.model(input_ids, positions, kv_caches, metas)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)
