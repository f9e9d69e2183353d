"""The engine's flat options (the offline API's keyword arguments and the CLI's flags) and
the one place they become an ``EngineConfig`` (vLLM's ``EngineArgs``). Defaults are read from
the config dataclasses, so each is written once."""

from __future__ import annotations

from dataclasses import dataclass

from openinfer import cpu_allocator
from openinfer.config import (
    CacheConfig,
    DataParallelConfig,
    EngineConfig,
    EPLBConfig,
    KVTransferConfig,
    ModelConfig,
    NodesConfig,
    SchedulerConfig,
    default_cpu_kv_cache_memory,
    resolve_device,
)
from openinfer.spec.config import SpeculativeConfig


@dataclass(frozen=True)
class EngineArgs:
    """Every option of ``LLM(model, **options)`` and ``openinfer serve``; each is documented
    on the config field it sets (openinfer/config.py)."""

    model: str
    tokenizer: str | None = None
    quantization: str | None = None
    """vLLM's --quantization: here only the checkpoint's own method, named ('fp8' for a
    block-scaled FP8 checkpoint, 'gguf' for a GGUF file); openinfer quantizes no weights
    itself, so any other is refused by name."""
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    # CacheConfig
    kv_cache_memory: int | None = CacheConfig.kv_cache_memory
    gpu_memory_utilization: float | None = CacheConfig.gpu_memory_utilization
    block_size: int = CacheConfig.block_size
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    kv_host_memory: int | None = CacheConfig.kv_host_memory
    kv_store_dir: str | None = CacheConfig.kv_store_dir
    kv_store_bytes: int = CacheConfig.kv_store_bytes
    kv_pin_memory: int | None = CacheConfig.kv_pin_memory
    kv_pin_memory_per_key: int | None = CacheConfig.kv_pin_memory_per_key
    kv_events_endpoint: str | None = CacheConfig.kv_events_endpoint
    kv_events_replay_endpoint: str | None = CacheConfig.kv_events_replay_endpoint
    kv_events_topic: str = CacheConfig.kv_events_topic
    window_snapshots: bool = CacheConfig.window_snapshots
    window_snapshot_interval: int = CacheConfig.window_snapshot_interval
    # SchedulerConfig
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    scheduling_policy: str = SchedulerConfig.policy
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    share_inflight_prefixes: bool = SchedulerConfig.share_inflight_prefixes
    async_scheduling: bool = SchedulerConfig.async_scheduling
    # EngineConfig
    seed: int | None = EngineConfig.seed
    skip_tokenizer_init: bool = EngineConfig.skip_tokenizer_init
    attention_backend: str = EngineConfig.attention_backend
    enforce_eager: bool = EngineConfig.enforce_eager
    batch_invariant: bool = False
    moe_expert_stats: bool = EngineConfig.moe_expert_stats
    speculative_config: str | dict | SpeculativeConfig | None = None
    tensor_parallel_size: int = EngineConfig.tensor_parallel_size
    enable_expert_parallel: bool = EngineConfig.enable_expert_parallel
    enable_eplb: bool = False
    eplb_config: str | dict | EPLBConfig | None = None
    prefill_context_parallel_size: int = EngineConfig.prefill_context_parallel_size
    distributed_executor_backend: str = EngineConfig.distributed_executor_backend
    ray_address: str | None = EngineConfig.ray_address
    # KVTransferConfig
    kv_role: str = KVTransferConfig.role
    kv_connector: str = KVTransferConfig.connector
    kv_transfer_host: str = KVTransferConfig.host
    kv_transfer_port: int | None = KVTransferConfig.port
    kv_transfer_timeout: float = KVTransferConfig.timeout_s
    kv_lease_s: float = KVTransferConfig.lease_s
    kv_load_failure_policy: str = KVTransferConfig.load_failure_policy
    kv_transfer_secret: str | None = None
    # DataParallelConfig
    data_parallel_size: int = DataParallelConfig.size
    data_parallel_rank: int = DataParallelConfig.rank
    data_parallel_address: str = DataParallelConfig.address
    data_parallel_rpc_port: int | None = DataParallelConfig.rpc_port
    # NodesConfig
    nnodes: int = NodesConfig.nnodes
    master_addr: str = NodesConfig.master_addr
    master_port: int = NodesConfig.master_port

    def create_engine_config(self) -> EngineConfig:
        device = resolve_device(self.device)
        self._check_memory_options(device)
        if device == "cpu":  # a malformed environment fails here, not in a worker
            if self.kv_cache_memory is None:
                default_cpu_kv_cache_memory()
            cpu_allocator.cache_limit()
        self._check_parallel_options()
        nodes = NodesConfig(self.nnodes, 0, self.master_addr, self.master_port)  # the engine: node 0
        if self.nnodes > 1:
            nodes.local_ranks(self.tensor_parallel_size * self.prefill_context_parallel_size)
        model_config = ModelConfig.from_pretrained(self.model, dtype=self.dtype, device=device,
                                                   max_model_len=self.max_model_len,
                                                   batch_invariant=self.batch_invariant)
        self._check_model_options(model_config)
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_host_memory=self.kv_host_memory, kv_store_dir=self.kv_store_dir,
                kv_store_bytes=self.kv_store_bytes, kv_events_endpoint=self.kv_events_endpoint,
                kv_pin_memory=self.kv_pin_memory, kv_pin_memory_per_key=self.kv_pin_memory_per_key,
                kv_events_replay_endpoint=self.kv_events_replay_endpoint,
                kv_events_topic=self.kv_events_topic, window_snapshots=self.window_snapshots,
                window_snapshot_interval=self.window_snapshot_interval),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                policy=self.scheduling_policy, enable_chunked_prefill=self.enable_chunked_prefill,
                share_inflight_prefixes=self.share_inflight_prefixes,
                async_scheduling=self.async_scheduling),
            device=device, seed=self.seed, tokenizer=self.tokenizer,
            skip_tokenizer_init=self.skip_tokenizer_init,
            kv_transfer=KVTransferConfig(
                role=self.kv_role, connector=self.kv_connector, host=self.kv_transfer_host,
                port=self.kv_transfer_port, timeout_s=self.kv_transfer_timeout,
                lease_s=self.kv_lease_s, load_failure_policy=self.kv_load_failure_policy,
                secret=self.kv_transfer_secret),
            attention_backend=self.attention_backend, enforce_eager=self.enforce_eager,
            moe_expert_stats=self.moe_expert_stats,
            speculative=SpeculativeConfig.parse(self.speculative_config),
            tensor_parallel_size=self.tensor_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            eplb=EPLBConfig.parse(self.eplb_config) if self.enable_eplb else None,
            data_parallel=DataParallelConfig(self.data_parallel_size, self.data_parallel_rank,
                                             self.data_parallel_address,
                                             self.data_parallel_rpc_port),
            prefill_context_parallel_size=self.prefill_context_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            ray_address=self.ray_address,
            nodes=nodes,
        )

    def _check_model_options(self, model: ModelConfig) -> None:
        """Refuse options this model cannot run with, in one line at start-up."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < model.max_model_len:
            # Unchunked, a longer prompt would wait forever at the head of the queue.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is below max_model_len "
                f"({model.max_model_len}) with chunked prefill off "
                "(--no-enable-chunked-prefill): a longer prompt could never be scheduled; "
                "raise --max-num-batched-tokens or lower --max-model-len")
        if self.quantization is not None:
            own = "gguf" if model.format == "gguf" else (
                (model.hf_config.get("quantization_config") or {}).get("quant_method"))
            if self.quantization != own:
                raise ValueError(
                    f"quantization {self.quantization!r} (--quantization): openinfer quantizes "
                    f"no weights itself, it loads a checkpoint's own quantization (this one "
                    f"has {repr(own) if own else 'none'}; block-scaled fp8 checkpoints are "
                    "'fp8', GGUF files 'gguf')")
        _refuse_kv_off_device(model, {
            "kv_host_memory (--kv-host-memory)": self.kv_host_memory is not None,
            "kv_store_dir (--kv-store-dir)": self.kv_store_dir is not None,
            f"kv_role {self.kv_role!r} (--role)": self.kv_role != "both",
            "kv_transfer_port (--kv-transfer-port)": self.kv_transfer_port is not None})

    def _check_memory_options(self, device: str) -> None:
        """vLLM's gpu_memory_utilization: a fraction in (0, 1], on CUDA, not with an explicit
        KV pool size."""
        u = self.gpu_memory_utilization
        if u is None:
            return
        if not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u}")
        if self.kv_cache_memory is not None:
            raise ValueError("give gpu_memory_utilization or kv_cache_memory, not both (the "
                             "first sizes the KV pool from the GPU's memory, the second in bytes)")
        if not device.startswith("cuda"):
            raise ValueError("gpu_memory_utilization (--gpu-memory-utilization) is a fraction of "
                             "a GPU's memory; on the CPU size the KV pool with kv_cache_memory "
                             "(--kv-cache-memory)")

    def _check_parallel_options(self) -> None:
        """Refuse combinations of the parallelism options that no engine runs."""
        if self.eplb_config is not None and not self.enable_eplb:
            raise ValueError("eplb_config is given but enable_eplb is not")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb needs enable_expert_parallel (it balances experts "
                             "spread over ranks)")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray, got "
                             f"{self.distributed_executor_backend!r}")
        if self.data_parallel_size > 1 and not self.enable_expert_parallel:
            raise ValueError("data_parallel_size > 1 inside one engine group needs "
                             "enable_expert_parallel (plain data parallelism is replicas "
                             "behind the router: `serve --data-parallel-size N`)")
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError("data-parallel attention with tensor_parallel_size > 1 per rank "
                             "is not supported yet")
        if self.nnodes > 1 and self.distributed_executor_backend != "mp":
            raise ValueError("nnodes > 1 is the mp backend's way over machines; the ray "
                             "backend places ranks on its cluster's nodes itself")


_LLAMA_WINDOWS = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
                  "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
"""Architectures whose layers' windows config.json gives as models/llama.py's
``sliding_window`` reads them."""


def _refuse_kv_off_device(model: ModelConfig, asked: dict[str, bool]) -> None:
    """One line at start-up, not an engine core's traceback, for an option that moves KV off
    the device (``asked``: its name -> given) on a model of sliding-window layers only: its
    pages stay on the device (the engine core refuses too, for every architecture)."""
    hf = model.hf_config
    given = [name for name, on in asked.items() if on]
    if not given or model.architecture not in _LLAMA_WINDOWS or not _every_layer_windowed(hf):
        return
    raise ValueError(f"{given[0]}: {model.architecture} has sliding-window layers only "
                     f"(sliding_window {hf['sliding_window']}), whose KV stays on the device; "
                     "the host/file KV tiers and disaggregation need a full-attention layer")


def _every_layer_windowed(hf: dict) -> bool:
    """Whether config.json gives every layer a window (models/llama.py ``sliding_window``)."""
    if not hf.get("sliding_window") or hf.get("use_sliding_window") is False:
        return False
    types = hf.get("layer_types")
    if types is not None:
        return all(t == "sliding_attention" for t in types)
    return hf.get("max_window_layers", 0) <= 0


def create_engine_config(model: str, **options) -> EngineConfig:
    """The whole config from flat options (``LLM(model, **options)``, the CLI's flags): each
    option is a field of ``EngineArgs``; an unknown one is a TypeError naming it."""
    return EngineArgs(model, **options).create_engine_config()
