"""Start-up checks of a multi-rank engine: what tensor, context and expert parallelism
cannot run for this model and configuration, refused by name before any rank starts."""

from __future__ import annotations

import os

import torch

from openinfer.config import EngineConfig, ModelConfig
from openinfer.models.arch import ArchConfig
from openinfer.models.registry import get_model_class


def check_context_parallel(config: EngineConfig) -> None:
    """Refuse at start-up what prefill context parallelism cannot run."""
    size, mc = config.prefill_context_parallel_size, config.model
    if size < 1:
        raise ValueError(f"prefill_context_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    if config.tensor_parallel_size > 1:
        raise ValueError("prefill_context_parallel_size with tensor_parallel_size > 1 is not "
                         "supported yet")
    _check_ranks_fit(config, size, "prefill_context_parallel_size")
    if not get_model_class(mc.architecture).supports_context_parallel:
        raise ValueError(f"prefill_context_parallel_size {size}: {mc.architecture} cannot be "
                         "split by context yet (Llama-family models with full attention can)")
    _refuse_unsupported(config, f"prefill_context_parallel_size {size}",
                        {"expert parallelism": config.enable_expert_parallel,
                         # Verification steps are short: they run whole on every rank,
                         # and token drafts are made alike there. A draft network's own
                         # prefill would be split, and is not taught to be.
                         "speculative decoding with a draft network":
                             config.speculative is not None and config.speculative.uses_model,
                         "--batch-invariant": config.model.batch_invariant})


def check_tensor_parallel(config: EngineConfig) -> None:
    """Refuse at start-up, naming the constraint, what the ranks could not run."""
    size, mc = config.tensor_parallel_size, config.model
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    _check_ranks_fit(config, size, "tensor_parallel_size")
    _check_split(mc.architecture, ArchConfig.from_hf(mc.hf_config), size, config.enable_expert_parallel)
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":  # split like the target
        draft = ModelConfig.from_pretrained(spec.model)
        _check_split(draft.architecture, ArchConfig.from_hf(draft.hf_config), size, False,
                     "the draft model's ")
    # (Every speculative method runs split: token drafters alike on every rank, a draft
    # model or MTP module split like the target, its layers reading the same parallel state.)
    _refuse_unsupported(config, f"tensor_parallel_size {size}", {
        # Two ranks' all-reduce adds two partial sums per element (exact whichever first);
        # over more ranks the order of the sums follows the tensor's size, so the batch.
        "--batch-invariant on more than 2 ranks": config.model.batch_invariant and size > 2,
        # (Overrides the multi-rank default.) With --nnodes each node's ranks lend their
        # shares from that node; Ray places ranks itself, and its ranks are not told where
        # they run yet. (The file store runs with ranks elsewhere where every node mounts
        # it: the core checks at start-up.)
        "disaggregation (--role / --kv-transfer-port)":
            _disaggregated(config) and config.distributed_executor_backend == "ray"})


def _check_split(architecture: str, arch: ArchConfig, size: int, expert_parallel: bool,
                 whose: str = "") -> None:
    """Refuse a model that ``size`` tensor-parallel ranks cannot split, naming why."""
    if not get_model_class(architecture).supports_tensor_parallel:
        raise ValueError(f"tensor_parallel_size {size}: {whose}{architecture} cannot be split "
                         "yet (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE and "
                         "DeepSeek-V2/V3/V4 models can)")
    heads, kv_heads = arch.num_heads, arch.num_kv_heads
    sizes = [(heads, "num_attention_heads"), (arch.intermediate_size, "intermediate_size"),
             (arch.raw.get("o_groups", 0), "o_groups")]  # DeepSeek-V4's grouped output
    if arch.moe.intermediate_size and not expert_parallel:
        sizes.append((arch.moe.intermediate_size, "moe_intermediate_size"))
    for n, what in sizes:
        if n % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide {whose}{what} ({n})")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} and {whose}num_key_value_heads "
                         f"({kv_heads}): one must divide the other")


def check_expert_parallel(config: EngineConfig) -> None:
    """Refuse at start-up an expert-parallel split the model cannot take."""
    if not config.enable_expert_parallel:
        return
    moe = ArchConfig.from_hf(config.model.hf_config).moe
    experts = moe.num_experts
    if not experts:
        raise ValueError(f"enable_expert_parallel: {config.model.architecture} has no routed "
                         "experts (it is not a mixture-of-experts model)")
    redundant = config.eplb.num_redundant_experts if config.eplb is not None else 0
    dp = config.data_parallel
    size = dp.size if dp.size > 1 else config.tensor_parallel_size
    ranks = "the data-parallel ranks" if dp.size > 1 else "the tensor-parallel ranks"
    if redundant > experts * (size - 1):
        raise ValueError(f"eplb_config.num_redundant_experts {redundant}: at most one replica "
                         f"of an expert per rank, so at most {experts * (size - 1)} with "
                         f"{size} rank(s)")
    if (experts + redundant) % size:
        raise ValueError(f"expert parallel size {size} ({ranks}) does not divide the physical "
                         f"experts ({experts} routed + {redundant} redundant)")
    if config.eplb is not None and config.eplb.policy == "hierarchical":
        groups = moe.num_groups
        nodes = config.nodes.nnodes if dp.size == 1 else 1  # (a DP group's are not known)
        per_node = (experts + redundant) // nodes
        if nodes == 1 or groups % nodes or size % nodes or experts % groups \
                or per_node > experts // nodes * (size // nodes):
            raise ValueError(f"eplb_config.policy hierarchical needs ranks on several nodes "
                             f"(--nnodes; here {nodes}) that divide the model's expert groups "
                             f"(n_group {groups}) and the {size} ranks, with at most one "
                             f"replica of an expert per rank of its node")
    if dp.size > 1:
        _refuse_unsupported(config, "data-parallel attention with expert parallelism",
                            {"--async-scheduling": config.scheduler.async_scheduling,
                             # A draft network's passes run MoE layers too: a rank drafting
                             # while another does not would break the lockstep.
                             "speculative decoding with a draft network":
                                 config.speculative is not None and config.speculative.uses_model,
                             "--batch-invariant": config.model.batch_invariant})


def _check_ranks_fit(config: EngineConfig, size: int, name: str) -> None:
    """One CUDA device per rank; on a CPU, no more ranks than cores (on this machine: Ray
    places its ranks on the cluster's nodes, and says when they do not fit)."""
    if config.distributed_executor_backend == "ray":
        return
    here = len(config.nodes.local_ranks(size))
    where = f" on each of {config.nodes.nnodes} nodes" if config.nodes.nnodes > 1 else ""
    if config.device.startswith("cuda"):
        if torch.cuda.device_count() < here:
            raise ValueError(f"{name} {size} needs {here} CUDA devices{where}; "
                             f"{torch.cuda.device_count()} visible")
    elif here > (os.cpu_count() or 1):
        raise ValueError(f"{name} {size} is {here} ranks{where}, more than CPU cores "
                         f"({os.cpu_count()})")


def _refuse_unsupported(config: EngineConfig, what: str,
                        more: dict[str, bool] | None = None) -> None:
    """The features not composed with multi-rank engines yet, refused by name."""
    unsupported = {
        "disaggregation (--role / --kv-transfer-port)": _disaggregated(config),
        **(more or {}),
    }
    for feature, on in unsupported.items():
        if on:
            raise ValueError(f"{what} does not run with {feature} yet")


def _disaggregated(config: EngineConfig) -> bool:
    return config.kv_transfer.role != "both" or config.kv_transfer.port is not None
