"""A worker: one device's model and its KV cache tensors; the bytes that move in and out
of them (host tier, file store, KV transfer) are its KV connector's, ``kv``
(transfer/worker_connector.py). The engine core never touches a tensor; it talks to
workers through an executor (executor/).

    EngineCore ──SchedulerOutput──> Executor ──> Worker ──> ModelRunner ──> model
               <─ModelRunnerOutput──              └─ kv: KV plan, I/O completions, leases
    KVConnector ── call_kv_connector(method, ...) ──> Worker.kv.<method>

Lifecycle, as the core drives it: load the model (``__init__``) -> report the layers' KV
specs and the memory the cache may take -> allocate the cache for the core's block count
(``initialize_kv_cache``) -> optionally attach the tiers and KV transfer (through ``kv``)
-> execute steps.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from openinfer import cpu_allocator
from openinfer.attention import select_attention_backend
from openinfer.config import (
    EngineConfig,
    ModelConfig,
    cuda_kv_cache_bytes,
    default_cpu_kv_cache_memory,
)
from openinfer.cpu_features import cpu_capability
from openinfer.distributed.context_parallel import get_cp
from openinfer.distributed.parallel_state import (
    COLLECTIVES,
    expert_parallel,
    get_tp,
    init_data_parallel_group,
)
from openinfer.engine.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from openinfer.huge_pages import huge_pages_in_use, system_mode
from openinfer.kernels.cpu_attention import (
    BF16_DOT_ENV,
    bf16_dot,
    choose_bf16_dot,
    load_cpu_attention,
)
from openinfer.kernels.custom_op import Platform
from openinfer.kernels.kv_quant import is_fp8, kv_cache_torch_dtype
from openinfer.kv.spec import KVSpec, LayerGroup, MLALatentSpec
from openinfer.layers.attention import Attention
from openinfer.layers.moe import FusedExperts
from openinfer.models.gemm_plans import describe_gemms
from openinfer.models.loader import load_model
from openinfer.models.platform import bind_platform
from openinfer.spec.draft_model import DraftModelDrafter, check_draft_model
from openinfer.spec.drafters import make_token_proposer
from openinfer.spec.dspark import DSparkDrafter, load_dspark_drafter
from openinfer.spec.mtp import MTPDrafter, mtp_layers
from openinfer.transfer.worker_connector import WorkerKVConnector
from openinfer.worker.decode_graphs import DecodeGraphs
from openinfer.worker.kv_cache import allocate_caches
from openinfer.worker.runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        mc = config.model
        start = time.perf_counter()
        self.lockstep = config.data_parallel.size > 1
        """A data-parallel rank of an expert-parallel group: every step runs on every rank."""
        if self.lockstep:
            init_data_parallel_group(config)
        with expert_parallel(config) as ep:
            self.model = load_model(mc, config.device, progress=progress)
        num_params = sum(p.numel() for p in self.model.parameters())
        self.dtype_name = str(mc.dtype).removeprefix("torch.")
        self.kv_dtype_name = self._kv_cache_dtype(self.model)
        """What the KV cache stores (--kv-cache-dtype): the model's dtype, or a float8 type."""
        gemm = describe_gemms(self.model)
        logger.info("%s (%s, %.0fM parameters) loaded in %.1f s: %s on %s (CPU capability %s); "
                    "GEMM %s", mc.path, mc.architecture, num_params / 1e6,
                    time.perf_counter() - start, self.dtype_name, config.device, cpu_capability(),
                    gemm.text)
        self.attention = select_attention_backend(config.attention_backend, config.device)
        attention_dot, kept_bytes = "", 0
        bind_platform(self.model, self._platform(mc.batch_invariant))
        if self.attention.name == "cpu":  # its extension also has the norms, SiLU-and-mul, GEMM
            kernels = load_cpu_attention()
            attention_dot = self._choose_bf16_attention()
            if cpu_allocator.install(kernels):  # (after the load: its transient blocks are gone)
                kept_bytes = cpu_allocator.cache_limit()
        huge_pages = "on" if huge_pages_in_use() else "off"
        logger.info("attention backend: %s; huge pages for tensors: %s (kernel THP mode %s); "
                    "CPU caching allocator: %s", self.attention.name, huge_pages, system_mode(),
                    f"keeps up to {kept_bytes / 2**20:.0f} MiB" if kept_bytes else "off")
        self.counted_experts = self._count_expert_tokens() if config.moe_expert_stats else {}
        """Model layer index -> its MoE experts, counting the tokens routed to them."""
        self.balancer = None
        if config.eplb is not None:
            from openinfer.worker.expert_balancer import ExpertBalancer

            # Groups of experts the routing picks first (DeepSeek-V3's n_group) and the
            # machines the ranks span (--nnodes; a data-parallel group's are not known)
            # decide whether the placement can keep each group on one node.
            self.balancer = ExpertBalancer(
                list(self._model_experts().values()), config.eplb, ep,
                num_groups=config.model.hf_config.get("n_group") or 1,
                num_nodes=1 if ep.across_data_parallel else config.nodes.nnodes)
        self.compute_info = {"dtype": self.dtype_name, "gemm": gemm.label,
                             "cpu_capability": cpu_capability(), "attention": self.attention.name,
                             "attention_bf16_dot": attention_dot, "huge_pages": huge_pages,
                             "cpu_allocator_cache": str(kept_bytes), "cuda_graphs": "",
                             "experts": self._experts_label()}
        """How this worker computes (the labels of the compute_info metric; cpu_allocator_cache: the
        bytes of freed blocks the caching CPU allocator may keep, 0 where it is off; cuda_graphs:
        the largest decode batch that replays a CUDA graph, empty where none does; experts: the
        routed experts' path, ``cpu`` (the fused kernel), ``cuda`` or ``native``, ``+fp8`` or
        ``+fp4`` where they hold a checkpoint's fp8 or MXFP4 weights, empty for a dense model)."""
        self.draft_model = self._load_draft_model(progress)
        if self.draft_model is not None:
            self._kv_cache_dtype(self.draft_model)
        self.runner: ModelRunner | None = None
        self.kv: WorkerKVConnector | None = None
        """The worker half of the KV connector: tiers and KV transfer (set up with the cache)."""

    # ---- set-up -----------------------------------------------------------------------

    def _kv_cache_dtype(self, model: torch.nn.Module) -> str:
        """The cache dtype's name for ``model``; ValueError where it cannot store float8."""
        dtype = kv_cache_torch_dtype(self.config.cache.kv_cache_dtype, self.config.model.dtype)
        if is_fp8(dtype) and not model.supports_fp8_kv_cache:
            raise ValueError(f"kv_cache_dtype {self.config.cache.kv_cache_dtype!r}: "
                             f"{type(model).__name__}'s caches cannot be float8 (its compressed "
                             "attention reads them unscaled); use --kv-cache-dtype auto")
        return str(dtype).removeprefix("torch.")

    def _platform(self, batch_invariant: bool) -> Platform:
        """What a model here is bound to: the cpu attention backend's extension also has the
        norms, rotary, SiLU-and-mul and few-row GEMM kernels."""
        kernels = load_cpu_attention() if self.attention.name == "cpu" else None
        return Platform(self.config.device, kernels, batch_invariant)

    def _choose_bf16_attention(self) -> str:
        """With a bf16 model on the cpu backend, the fastest bf16 product path of the
        attention kernel on this CPU (timed on the model's shape); "" otherwise."""
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if self.config.model.dtype != torch.bfloat16 or not layers:
            return ""
        layer = layers[0]
        times = choose_bf16_dot(layer.num_heads, layer.num_kv_heads, layer.head_dim,
                                self.config.cache.block_size)
        timed = ", ".join(f"{path} {seconds * 1e3:.2f} ms" for path, seconds in times.items())
        logger.info("bf16 attention products: %s (%s)", bf16_dot(),
                    f"256-token prefill: {timed}" if timed else f"{BF16_DOT_ENV} or one path")
        return bf16_dot()

    def compute_info_labels(self) -> dict[str, str]:
        return dict(self.compute_info)

    def weight_bytes(self) -> int:
        """Bytes of this worker's model weights (its shard, under tensor parallelism);
        a prepacked GEMM weight counts as the plain one it replaced."""
        seen, total = set(), 0
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
        return total

    def collective_stats(self) -> dict[str, list[int]]:
        """Tensor parallel: calls and payload bytes of each collective so far."""
        return {name: list(entry) for name, entry in COLLECTIVES.items()}

    def expert_placements(self) -> dict:
        """Expert parallel: the expert in each physical slot of each MoE layer, and EPLB's
        counters."""
        placements = {layer: list(m.placement.physical_to_logical)
                      for layer, m in self._model_experts().items() if m.placement is not None}
        return {"placements": placements,
                "eplb": vars(self.balancer.stats) if self.balancer is not None else None}

    def eplb_stats(self) -> dict[str, int]:
        s = self.balancer.stats
        return {"eplb_rearrangements": s.rearrangements, "eplb_experts_moved": s.experts_moved,
                "eplb_bytes_moved": s.bytes_received}

    def runner_request_ids(self) -> list[str]:
        """Requests the model runner holds state for (tests: none once idle)."""
        return sorted(self.runner.requests) if self.runner is not None else []

    def _experts_label(self) -> str:
        def weights(e: FusedExperts) -> str:
            if e.packed is None or e.packed.w13_scale is None:
                return ""
            return "+fp4" if e.packed.w13.dtype == torch.uint8 else "+fp8"

        return ",".join(sorted({e.forward_path.removeprefix("forward_") + weights(e)
                                for e in self._model_experts().values()}))

    def _model_experts(self) -> dict[str, FusedExperts]:
        """Layer index -> the layer's experts (not the MTP modules', which drafting runs)."""
        experts = {}
        for name, module in self.model.named_modules():
            parts = name.split(".")
            if isinstance(module, FusedExperts) and "layers" in parts:
                experts[parts[parts.index("layers") + 1]] = module
        return experts

    def _count_expert_tokens(self) -> dict[str, FusedExperts]:
        counted = self._model_experts()
        for module in counted.values():
            module.count_tokens()
        if not counted:
            raise ValueError(f"moe_expert_stats: {self.config.model.architecture} has no MoE layers")
        return counted

    def expert_token_counts(self) -> dict[str, list[int]]:
        """Tokens routed to each expert of each MoE layer so far (layer index -> counts)."""
        return {layer: m.token_counts.tolist() for layer, m in self.counted_experts.items()}

    def _load_draft_model(self, progress: bool):
        spec = self.config.speculative
        if spec is None or spec.method not in ("draft_model", "dspark"):
            return None
        mc = self.config.model
        if spec.method == "dspark":
            model = load_dspark_drafter(spec.model, self.model, mc, self.config.device, progress)
            bind_platform(model, self._platform(mc.batch_invariant))
            return model
        draft_config = ModelConfig.from_pretrained(spec.model, dtype=mc.dtype,
                                                   device=self.config.device)
        check_draft_model(mc, draft_config, self.config.tokenizer)
        model = load_model(draft_config, self.config.device, progress=progress)
        bind_platform(model, self._platform(draft_config.batch_invariant))
        logger.info("draft model %s (%s, %.0fM parameters): %d tokens per proposal", spec.model,
                    draft_config.architecture, sum(p.numel() for p in model.parameters()) / 1e6,
                    spec.num_speculative_tokens)
        return model

    def kv_cache_specs(self) -> list[KVSpec | None]:
        """The model's declaration of what each layer keeps per token (a draft model's
        layers follow the target's)."""
        block_size = self.config.cache.block_size
        specs = self.model.kv_cache_specs(block_size, self.kv_dtype_name)
        if self.draft_model is not None:
            specs = specs + self.draft_model.kv_cache_specs(block_size, self.kv_dtype_name)
        spec = self.config.speculative
        if spec is not None and spec.method == "mtp":
            layers = mtp_layers(self.model)
            if layers is None:
                raise ValueError(f"speculative_config.method 'mtp': {self.config.model.architecture} "
                                 "has no MTP module loaded (num_nextn_predict_layers is 0, or "
                                 "the checkpoint lacks its weights)")
            attn = layers[0].block.self_attn
            specs = specs + [MLALatentSpec(block_size, attn.latent_dim, attn.rope_dim, self.kv_dtype_name)]
        return specs

    def kv_cache_memory(self) -> int:
        """Bytes the KV cache may take on this worker's device."""
        memory = self.config.cache.kv_cache_memory
        if memory is not None:
            return memory
        if self.config.device.startswith("cuda"):
            free, total = torch.cuda.mem_get_info()
            return cuda_kv_cache_bytes(free, total, self.config.cache.gpu_memory_utilization)
        return default_cpu_kv_cache_memory()

    def initialize_kv_cache(self, groups: list[LayerGroup], num_blocks: int) -> None:
        """One tensor per layer group, views of one buffer of ``num_blocks`` pages, and the
        runner over them."""
        self.groups = groups
        self.kv_caches = allocate_caches(groups, num_blocks, self.config.device)
        self.kv = WorkerKVConnector(self.config, self.kv_caches)
        spec = self.config.speculative
        specs = self.kv_cache_specs()
        drafter = None
        first = len(self.model.kv_cache_specs(self.config.cache.block_size, self.kv_dtype_name))
        if spec is not None and spec.method == "dspark":
            drafter = DSparkDrafter(self.draft_model, self.model, first, spec.num_speculative_tokens)
        elif self.draft_model is not None:
            drafter = DraftModelDrafter(self.draft_model, first, spec.num_speculative_tokens)
        elif spec is not None and spec.method == "mtp":
            drafter = MTPDrafter(self.model, first, spec.num_speculative_tokens)
        self.runner = ModelRunner(self.model, groups, self.kv_caches, len(specs),
                                  self.config.device, self.attention, seed=self.config.seed,
                                  proposer=make_token_proposer(spec),
                                  num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                                  drafter=drafter)
        self._capture_decode_graphs()

    def _capture_decode_graphs(self) -> None:
        """CUDA graphs for the runner's decode steps (worker/decode_graphs.py), where they
        apply; a model whose forward pass cannot be captured runs eagerly, after a warning."""
        config = self.config
        if torch.device(config.device).type != "cuda" or config.enforce_eager:
            return
        refusal = self._decode_graphs_refusal()
        if refusal is not None:
            logger.info("CUDA graphs: off (%s); decode runs eagerly", refusal)
            return
        graphs = DecodeGraphs(self.model, self.runner.layer_caches, self.runner.layer_group,
                              len(self.groups), self.attention, config.cache.block_size,
                              config.model.max_model_len, config.scheduler.max_num_seqs,
                              torch.device(config.device), capture=True)
        try:
            graphs.capture_all()
        except Exception as exc:  # an op that cannot be captured (a host sync, a dynamic shape)
            logger.warning("CUDA graphs: off, the model's decode step could not be captured "
                           "(%s: %s); decode runs eagerly (--enforce-eager skips trying)",
                           type(exc).__name__, exc)
            return
        self.runner.decode_graphs = graphs
        self.compute_info["cuda_graphs"] = str(graphs.sizes[-1])

    def _decode_graphs_refusal(self) -> str | None:
        """Why decode steps cannot replay graphs here (not yet built for these), or None."""
        if not self.model.supports_decode_graphs:
            return f"{type(self.model).__name__} plans its attention from each step's lengths"
        if self.attention.name != "triton":
            return f"the {self.attention.name} attention backend plans from each step's lengths"
        if self.runner.drafter is not None:
            return "a model drafter reads the step's metadata"
        if get_tp().size > 1 or get_cp().size > 1 or self.lockstep:
            return "tensor, context or data parallelism (collectives are not captured yet)"
        return None

    def profile_step_seconds(self, rows: list[int], query_len: int) -> list[tuple[int, float]]:
        """Seconds of one model step at each number of rows (confidence scheduling's SPS)."""
        return self.runner.profile_step_seconds(rows, query_len)

    # ---- steps ------------------------------------------------------------------------

    def execute_model(self, sched: SchedulerOutput) -> None:
        """The step's KV plan (stores, then loads, before the forward pass may overwrite a
        block; reads and releases queued on I/O threads), then the forward pass."""
        self.kv.execute(sched.kv)
        self.runner.execute(sched)
        if self.lockstep and sched.is_empty:
            self._run_experts_for_others()
        if self.balancer is not None:
            self.balancer.step()

    def any_rank_busy(self, busy: bool) -> bool:
        """Data-parallel ranks: whether any of them has requests (then all of them step)."""
        flag = torch.tensor([int(busy)])
        torch.distributed.all_reduce(flag)
        return bool(flag.item())

    @torch.inference_mode()
    def _run_experts_for_others(self) -> None:
        """A data-parallel rank with nothing to compute still holds experts the others'
        tokens need: it joins every MoE layer's exchange, in layer order, with no tokens."""
        for experts in self._model_experts().values():
            hidden = experts.w13.shape[2]
            experts(experts.w13.new_empty(0, hidden), torch.empty(0, 0),
                    torch.empty(0, 0, dtype=torch.long))

    def sample_tokens(self, grammar: GrammarBitmask | None) -> ModelRunnerOutput:
        """The tokens of the step ``execute_model`` ran, under its grammar masks."""
        return self.runner.sample(grammar)

    def run_step(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """A whole step without grammar masks, in one call (a rank's pipelined steps)."""
        self.execute_model(sched)
        return self.sample_tokens(None)

    def call_kv_connector(self, method: str, *args: Any) -> Any:
        """The one RPC of the engine core's KV connector (engine/kv_connector.py): ``method``
        of this worker's half, ``kv``."""
        return getattr(self.kv, method)(*args)

    # ---- shutdown ---------------------------------------------------------------------

    def shutdown(self) -> None:
        if self.kv is not None:
            self.kv.shutdown()
