"""Engine configuration: frozen dataclasses, built once and never mutated."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from openinfer.cpu_features import auto_cpu_dtype, cpu_flags
from openinfer.spec.config import SpeculativeConfig
from openinfer.units import env_bytes

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3
"""Bytes of KV cache on CPU when neither --kv-cache-memory nor CPU_KV_CACHE_MEMORY_ENV is given
(allocated, zeroed, at start)."""
CPU_KV_CACHE_MEMORY_ENV = "OPENINFER_CPU_KV_CACHE_MEMORY"
"""The CPU KV pool's default size, e.g. ``8GiB`` (vLLM's CPU build has VLLM_CPU_KVCACHE_SPACE):
for a machine's every engine, the servers a router or a test suite starts included."""


def default_cpu_kv_cache_memory() -> int:
    """Bytes of KV cache on CPU when --kv-cache-memory is not given; raises ValueError for a
    malformed OPENINFER_CPU_KV_CACHE_MEMORY."""
    value = env_bytes(CPU_KV_CACHE_MEMORY_ENV)
    return DEFAULT_CPU_KV_CACHE_MEMORY if value is None else value
CUDA_MEMORY_UTILIZATION = 0.9
"""Fraction of free GPU memory (after weights) given to the KV cache by default on CUDA."""


def cuda_kv_cache_bytes(free: int, total: int, utilization: float | None) -> int:
    """The KV pool on a CUDA device with ``free`` of ``total`` bytes free once the weights
    are loaded: by default CUDA_MEMORY_UTILIZATION of what is free; with vLLM's
    ``--gpu-memory-utilization`` u, what is left of u x total after everything this
    process holds (weights, workspace), as vLLM counts it."""
    if utilization is None:
        return int(free * CUDA_MEMORY_UTILIZATION)
    left = int(utilization * total) - (total - free)
    if left <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization}: {utilization:.0%} of the GPU's "
                         f"{total / 2**30:.1f} GiB leaves nothing for the KV cache after the "
                         f"{(total - free) / 2**30:.1f} GiB already in use")
    return left
DEFAULT_KV_HOST_MEMORY_WITH_STORE = 512 * 1024**2
"""Host tier bytes when only --kv-store-dir is given: blocks read from files pass through it."""


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs from a model: a Hugging Face checkpoint's config.json, or the
    same facts read from a GGUF file's metadata."""

    path: str
    """Local files: a checkpoint directory (format 'hf') or a .gguf file (format 'gguf'),
    whatever ``--model`` named (see openinfer.model_source.resolve_model)."""
    architecture: str
    hf_config: dict = field(repr=False, hash=False, compare=False)
    """The raw config.json (or its GGUF equivalent); model classes read their own fields from it."""
    dtype: torch.dtype
    """Compute dtype. 'auto': the checkpoint's on CUDA; on CPU bfloat16 for a bfloat16 checkpoint
    on a CPU with AVX512_BF16 or AMX, else float32 (openinfer.cpu_features.auto_cpu_dtype)."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    """Longest sequence (prompt + output) a request may have."""
    eos_token_ids: tuple[int, ...]
    format: Literal["hf", "gguf"]
    """'hf': config.json + safetensors in ``path``; 'gguf': ``path`` is one .gguf file."""
    served_name: str
    """The model name the server shows unless told otherwise (--served-model-name)."""
    batch_invariant: bool = False
    """--batch-invariant: compute so that a request's logits are bitwise the same whatever else
    is in the batch (CPU only; openinfer.kernels.invariant_gemm)."""

    @staticmethod
    def from_pretrained(
        model: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        max_model_len: int | None = None,
        batch_invariant: bool = False,
    ) -> ModelConfig:
        """Resolve ``model`` (a directory, .gguf file, built-in name or Hub id) and read it."""
        if batch_invariant and device != "cpu":
            raise ValueError(f"batch_invariant: supported on CPU only, not on {device}")
        from openinfer.model_source import resolve_model

        source = resolve_model(str(model))
        path = Path(source.path)
        if source.format == "gguf":
            from openinfer.gguf_file import read_config

            hf = read_config(path)
        else:
            hf = _read_config_json(path)
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError(f"model: config.json in {str(path)!r} names no architectures")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        derived_max_len = _derive_max_model_len(hf)
        if max_model_len is None:
            max_model_len = derived_max_len
        elif max_model_len > derived_max_len:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's context length ({derived_max_len})"
            )
        return ModelConfig(
            path=str(path),
            architecture=archs[0],
            hf_config=hf,
            dtype=_resolve_dtype(dtype, hf, device),
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_model_len=max_model_len,
            eos_token_ids=_eos_token_ids(path, hf),
            format=source.format,
            served_name=source.served_name,
            batch_invariant=batch_invariant,
        )


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""``--kv-cache-dtype`` (vLLM's names): ``auto`` stores KV in the model's dtype; ``fp8`` is
``fp8_e4m3`` (openinfer/kernels/kv_quant.py)."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_dtype: str = "auto"
    """What the KV cache stores: the model's dtype (``auto``) or float8 (``fp8``/``fp8_e4m3``,
    ``fp8_e5m2``) with a per-tensor scale per layer's K and V: half a bf16 cache's bytes, twice
    the tokens in the same memory."""
    kv_cache_memory: int | None = None
    """Bytes for the KV block pool; None picks a default for the device (see module constants)."""
    gpu_memory_utilization: float | None = None
    """CUDA, vLLM's meaning: the fraction of the GPU's memory this instance may use in all,
    the KV pool taking what the weights leave (``cuda_kv_cache_bytes``); None: 0.9 of what
    is free after the weights."""
    enable_prefix_caching: bool = True
    """Keep full blocks under their content hash so requests with a common prefix share them."""
    kv_host_memory: int | None = None
    """Bytes of host memory for tier L2 (blocks copied there as they are cached); None: off."""
    kv_store_dir: str | None = None
    """Directory of tier L3, the file store (local disk, or a shared 3FS/NFS mount)."""
    kv_store_bytes: int = 16 * 1024**3
    """Most bytes the file store may hold; least recently used blocks are deleted past it."""
    kv_pin_memory: int | None = None
    """Most bytes of KV that prompts may pin in all (prompt caching: Anthropic's
    ``cache_control``, OpenAI's ``prompt_cache_retention``); None: half the host tier, or half
    the device pool without one."""
    kv_pin_memory_per_key: int | None = None
    """Most bytes of KV one API key's prompts may pin; None: a quarter of ``kv_pin_memory``."""
    kv_events_endpoint: str | None = None
    """ZMQ PUB address for KV events (vLLM's schema), e.g. tcp://*:5557; None: off."""
    kv_events_replay_endpoint: str | None = None
    """ZMQ ROUTER address where a subscriber asks for batches it missed."""
    kv_events_topic: str = ""
    window_snapshots: bool = True
    """Sliding-window layers keep their pages in the prefix cache only at window snapshots
    (every ``window_snapshot_interval`` tokens and at a request's last full block): a hit
    resumes from the latest snapshot behind it and recomputes the rest (at most one
    interval). False: every window page stays cached until evicted."""
    window_snapshot_interval: int = 512
    """Tokens between window snapshots (a multiple of block_size)."""

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.window_snapshot_interval < self.block_size or self.window_snapshot_interval % self.block_size:
            raise ValueError(f"window_snapshot_interval ({self.window_snapshot_interval}) must be a "
                             f"positive multiple of block_size ({self.block_size})")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill chunks + decodes)."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    policy: str = "fcfs"
    """'fcfs' or 'priority' (lower SamplingParams.priority first, then arrival)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    share_inflight_prefixes: bool = True
    """A waiting request whose next prefix block another request is computing waits for
    it (then hits) instead of computing it again."""
    async_scheduling: bool = False
    """Schedule step N+1 while step N computes (the model runs on its own thread), and
    process step N's outputs meanwhile. Steps with speculative drafts or grammar masks run
    one at a time (they need step N's tokens first)."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


KV_ROLES = ("both", "prefill", "decode")
KV_CONNECTORS = ("tcp", "shm", "file")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (openinfer/transfer/)."""
    role: str = "both"
    """prefill: hold finished prompts' KV for pickup; decode: pull it before decoding;
    both: a colocated instance (serves the KV it holds only when ``port`` is set)."""
    connector: str = "tcp"
    """How a decode instance pulls blocks: tcp, shm (same host) or file (a shared store)."""
    host: str = "127.0.0.1"
    """Address this instance's KV server binds and advertises to decode instances."""
    port: int | None = None
    """KV server port (0: any free port). A prefill instance always runs one."""
    timeout_s: float = 10.0
    """A pull that makes no progress for this long fails (and falls back)."""
    lease_s: float = 30.0
    """A prefill instance frees KV nobody pulled (or renewed) for this long."""
    load_failure_policy: str = "recompute"
    """When a pull fails: recompute the missing blocks locally, or fail the request."""
    secret: str | None = field(default=None, repr=False)
    """Shared by the prefill and decode instances: the KV server refuses (and counts) a
    connection whose frames do not carry it. None: any puller that names a live lease."""

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"kv role must be one of {', '.join(KV_ROLES)}, got {self.role!r}")
        if self.connector not in KV_CONNECTORS:
            raise ValueError(f"kv connector must be one of {', '.join(KV_CONNECTORS)}, "
                             f"got {self.connector!r}")
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv load failure policy must be 'recompute' or 'fail', "
                             f"got {self.load_failure_policy!r}")

    @property
    def serves_kv(self) -> bool:
        return self.role == "prefill" or (self.role == "both" and self.port is not None)

    @property
    def pulls_kv(self) -> bool:
        return self.role in ("decode", "both")


@dataclass(frozen=True)
class EPLBConfig:
    """Expert-parallel load balancing (``--enable-eplb``, ``--eplb-config``; vLLM's names):
    every ``step_interval`` steps the experts are placed again for the load of the last
    ``window_size`` steps (openinfer/distributed/eplb.py)."""

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    """Physical expert slots beyond one per routed expert: replicas of hot experts."""
    policy: str = "auto"
    """global: any replica on any rank; hierarchical: each expert group kept on one node
    (ranks on several machines, a model with expert groups); auto: hierarchical where the
    nodes divide the groups, else global."""

    def __post_init__(self) -> None:
        if self.policy not in ("auto", "global", "hierarchical"):
            raise ValueError(f"eplb_config.policy must be auto, global or hierarchical, got "
                             f"{self.policy!r}")
        for name in ("window_size", "step_interval", "num_redundant_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"eplb_config.{name} must be a non-negative integer, got {value!r}")
        if not 1 <= self.window_size <= self.step_interval:
            raise ValueError(f"eplb_config: need 1 <= window_size ({self.window_size}) <= "
                             f"step_interval ({self.step_interval})")

    @staticmethod
    def parse(value: str | dict | EPLBConfig | None) -> EPLBConfig:
        """From the CLI's JSON string or the offline API's dict; unknown keys refused by name."""
        if value is None or isinstance(value, EPLBConfig):
            return value or EPLBConfig()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--eplb-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"eplb_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(EPLBConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"eplb_config: unknown field(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        return EPLBConfig(**value)


@dataclass(frozen=True)
class DataParallelConfig:
    """Data-parallel attention inside one expert-parallel group (DeepSeek's deployment):
    this engine is rank ``rank`` of ``size``; each schedules its own requests, and all of
    them run every step together, for the MoE layers' collectives (an engine without
    requests runs its experts for the others). ``serve --data-parallel-size N
    --enable-expert-parallel`` starts the N engines and a router; one engine alone is
    ``serve --data-parallel-size N --data-parallel-rank I`` (one per node, say)."""

    size: int = 1
    rank: int = 0
    address: str = "127.0.0.1"
    """Where rank 0 listens for the others to join the group."""
    rpc_port: int | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"data_parallel_rank {self.rank} is not a rank of "
                             f"data_parallel_size {self.size}")
        if self.size > 1 and self.rpc_port is None:
            raise ValueError("data-parallel ranks of one expert-parallel group need "
                             "data_parallel_rpc_port (where they join the group)")


@dataclass(frozen=True)
class NodesConfig:
    """One tensor/context-parallel group over several machines, with torchrun's names: node
    0 runs the server, the engine core and ranks 0..k-1 (k = ranks / nnodes); node i runs
    ranks i·k..(i+1)·k-1 headless (``serve --node-rank i``). The ranks join torch.distributed
    at ``master_addr:master_port`` and the engine core's calls at ``master_port + 1``."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is not a node of nnodes {self.nnodes}")
        if not 0 < self.master_port < 65535:
            raise ValueError(f"master_port must be a TCP port below 65535 (the next one "
                             f"carries the engine's calls), got {self.master_port}")

    def local_ranks(self, num_ranks: int) -> range:
        """The group's ranks that run on this node."""
        if num_ranks % self.nnodes:
            raise ValueError(f"{num_ranks} ranks do not split evenly over nnodes "
                             f"{self.nnodes}")
        per_node = num_ranks // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str = "cpu"
    seed: int | None = None
    """Seed of the engine-wide generator used by unseeded requests."""
    tokenizer: str | None = None
    """Tokenizer path; defaults to the model's resolved path (a .gguf file carries its own)."""
    skip_tokenizer_init: bool = False
    """Run on token ids only (no text in or out)."""
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    attention_backend: str = "auto"
    """torch (the reference), cpu (the C++ paged kernel) or auto (the fastest that runs here;
    see openinfer/attention/selector.py)."""
    enforce_eager: bool = False
    """CUDA: run decode steps eagerly instead of replaying CUDA graphs
    (openinfer/worker/decode_graphs.py); no effect on a CPU."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (``--speculative-config``); None: off."""
    grammar_cache_size: int = 256
    """Structured outputs: compiled grammars kept (LRU), keyed by the grammar."""
    moe_expert_stats: bool = False
    """Count the tokens routed to each expert of each MoE layer (the stats'
    ``moe_expert_tokens`` and the ``moe_expert_tokens`` metric; off: no per-step cost)."""
    tensor_parallel_size: int = 1
    """Ranks the model's layers are split over (one worker process per rank beyond the
    first; openinfer/distributed/)."""
    enable_expert_parallel: bool = False
    """MoE layers: whole experts spread over the tensor-parallel ranks instead of every
    expert sliced over them."""
    eplb: EPLBConfig | None = None
    """Expert-parallel load balancing; None: off (experts stay where they were loaded)."""
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    distributed_executor_backend: str = "mp"
    """How the ranks run: ``mp`` (processes on this machine) or ``ray`` (Ray actors, which
    may span a cluster's nodes)."""
    ray_address: str | None = None
    """The Ray cluster the ``ray`` backend joins (None: a private local instance)."""
    prefill_context_parallel_size: int = 1
    """Ranks (worker processes, each with the whole model and KV cache) that split a long
    prompt chunk's tokens between them (openinfer/distributed/context_parallel.py)."""
    nodes: NodesConfig = field(default_factory=NodesConfig)
    """The machines the ranks run on (the ``mp`` backend; openinfer/executor/nodes.py)."""

    @property
    def num_ranks(self) -> int:
        """Worker processes of this engine (1: the worker runs in the engine's process)."""
        return self.tensor_parallel_size * self.prefill_context_parallel_size


def resolve_device(device: str) -> str:
    """``auto``: the first CUDA device when torch sees one, else the CPU."""
    if device == "auto":
        import torch  # here only: the control plane imports this module and loads no torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {device!r}")
    return device


def _read_config_json(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model: no config.json in {str(path)!r} (expected a Hugging Face checkpoint)")
    hf = json.loads(config_file.read_text())
    if hf.get("model_type") in NESTED_TEXT_CONFIGS and "text_config" in hf:
        return flatten_text_config(hf)
    if "text_config" in hf and "num_hidden_layers" not in hf:
        raise ValueError(f"model: multimodal checkpoints are not supported ({path})")
    return hf


NESTED_TEXT_CONFIGS = ("deepseek_v41",)
"""Models whose config.json nests the language model's keys under ``text_config`` (beside
``vision_config``) and which openinfer serves as text models: DeepSeek-V4.1."""


def flatten_text_config(hf: dict) -> dict:
    """The language model's keys at the top level, as every other reader expects: the top
    level's own keys (architectures, dtype, quantization_config, the special token ids,
    vision_config) kept, ``text_config``'s over them."""
    flat = {k: v for k, v in hf.items() if k != "text_config"}
    flat.update(hf["text_config"])
    return flat


def _derive_max_model_len(hf: dict) -> int:
    max_len = hf.get("max_position_embeddings")
    if max_len is None:
        raise ValueError("model: config.json has no max_position_embeddings")
    return int(max_len)


def _resolve_dtype(dtype: str | torch.dtype, hf: dict, device: str) -> torch.dtype:
    import torch  # here only: the control plane imports this module and loads no torch

    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if dtype == "auto":
        if device == "cpu":
            # bf16 only where the CPU has bf16 dot products: elsewhere it computes as fp32 does.
            choice, reason = auto_cpu_dtype(hf.get("torch_dtype") or hf.get("dtype"), cpu_flags())
            logger.info("dtype auto: %s on this CPU (%s)", str(choice).removeprefix("torch."),
                        reason)
            return choice
        name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        return names.get(name, torch.float32)
    if dtype not in names:
        raise ValueError(f"dtype must be one of {['auto', *names]}, got {dtype!r}")
    return names[dtype]


def _eos_token_ids(path: Path, hf: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json (which may list several) or config.json (a GGUF's
    config lists its end-of-generation ids)."""
    eos = None
    gen_file = path / "generation_config.json"
    if path.is_dir() and gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
    if eos is None:
        eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
