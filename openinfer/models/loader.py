"""Builds a model from a Hugging Face checkpoint directory (config.json + *.safetensors) or a
GGUF file (openinfer.gguf_file turns its tensors into Hugging Face names and float32)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from openinfer import gguf_file
from openinfer.config import ModelConfig
from openinfer.distributed.parallel_state import get_tp
from openinfer.layers.attention import Attention
from openinfer.layers.linear import GemmLayer, default_weight_loader
from openinfer.layers.mla import MLAAttention
from openinfer.layers.moe import FusedExperts
from openinfer.models import fp8
from openinfer.models.arch import ArchConfig
from openinfer.models.base import CausalLM
from openinfer.models.engram import Engram
from openinfer.models.gemm_plans import plan_gemms, weight_owners
from openinfer.models.platform import make_batch_invariant
from openinfer.models.registry import get_model_class

logger = logging.getLogger(__name__)

# Checkpoint tensors that carry no weights (older checkpoints saved RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_model(config: ModelConfig, device: str | torch.device = "cpu",
               progress: bool = True, gemm: str | None = None) -> nn.Module:
    """The model with its weights, ready for inference. On CPU each linear layer then gets
    a GEMM plan (openinfer.kernels.gemm_plan; ``gemm``: its mode, default $OPENINFER_CPU_GEMM), or,
    with ``config.batch_invariant``, a batch-invariant one (openinfer.kernels.invariant_gemm)."""
    cls = get_model_class(config.architecture)
    with torch.device(device), default_dtype(config.dtype):
        model = cls(ArchConfig.from_hf(config.hf_config, source_dir=config.path))
    # (batch-invariant plans are made for plain weights: fp8 ones are multiplied out for them)
    load_weights(model, Path(config.path), progress=progress, hf_config=config.hf_config,
                 keep_fp8=not config.batch_invariant and fp8.keeps_fp8())
    process_weights_after_loading(model)
    if config.batch_invariant:
        make_batch_invariant(model)
    else:
        plan_gemms(model, gemm)
    return model.eval()


def process_weights_after_loading(model: nn.Module) -> None:
    """Runs every module's ``process_weights_after_loading()`` (vLLM's name): weights derived
    from loaded ones (MLA's absorbed maps) are made here, before a GEMM plan may replace a
    planned layer's plain weight by a meta tensor; after the plans, only the plan reads it."""
    for module in model.modules():
        prepare = getattr(module, "process_weights_after_loading", None)
        if prepare is not None:
            prepare()


def load_weights(model: CausalLM, path: Path, progress: bool = True,
                 hf_config: dict | None = None, keep_fp8: bool = False) -> None:
    """Loads every parameter of ``model`` from the checkpoint at ``path``; ``hf_config`` (its
    config.json) says whether the weights are quantized (openinfer.models.fp8), and
    ``keep_fp8`` whether linear layers then hold them as loaded."""
    params = dict(model.named_parameters())  # shared (tied) weights appear once
    packed = model.packed_modules
    names = CheckpointNames(packed, model.checkpoint_renames, model.expert_weights,
                            model.checkpoint_prefixes)
    loaded: set[str] = set()
    unexpected: list[str] = []
    if path.is_file():  # a checkpoint is a directory; a single file is a GGUF
        if names.expert_weights:
            raise ValueError(f"{type(model).__name__}: GGUF checkpoints of mixture-of-experts "
                             "models are not supported; use the Hugging Face checkpoint")

        tensors = ((name, torch.from_numpy(array)) for name, array in
                   gguf_file.iter_tensors(path, _checkpoint_names(model, packed), progress))
    else:
        fp8_block = fp8.block_size_of(hf_config or {})
        # Tensor parallel: sharded parameters read only their slice of each tensor.
        tensors = _iter_checkpoint(path, progress, slices=get_tp().size > 1 and fp8_block is None)
        if fp8_block is not None:
            fp4 = fp8.fp4_experts(hf_config or {})
            kept = (_keep_fp8_layers(model, path, names, fp8_block, fp4_experts=fp4)
                    if keep_fp8 else set())
            if fp4 and not any(name.endswith(".w13") for name in kept):
                logger.info("%s: its FP4 (MXFP4) routed experts are multiplied out to the "
                            "model's dtype while loading", path)
            params = dict(model.named_parameters())  # with the layers' fp8 parameters
            tensors = fp8.dequantizing(((fp8.canonical_name(name), t) for name, t in tensors),
                                       fp8_block, lambda name: names.map(name)[0] in kept)
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or _load_kv_scale(model, names, name, tensor):
            continue
        target, shard = names.map(name)
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        if not isinstance(tensor, torch.Tensor) and not getattr(loader, "reads_slices", False):
            tensor = tensor[:]  # a safetensors slice, read whole
        with torch.no_grad():
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    for optional in model.optional_modules:
        # A module the checkpoint may lack entirely (DeepSeek's MTP layers): dropped if so.
        own = [n for n in params if n.startswith(optional + ".")]
        if own and set(own) <= set(missing):
            parent, _, child = optional.rpartition(".")
            setattr(model.get_submodule(parent), child, nn.ModuleList())
            missing = [n for n in missing if n not in own]
            logger.info("%s: the checkpoint has no weights for %s; dropped", path, optional)
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks weights for: {', '.join(missing[:8])}"
                         + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    if unexpected:
        logger.warning("ignored %d checkpoint tensors the model does not use, e.g. %s",
                       len(unexpected), unexpected[:4])


KV_SCALE_NAMES = {"k_scale": ("k_scale",), "v_scale": ("v_scale",),
                  "kv_scale": ("k_scale", "v_scale")}
"""A checkpoint's KV cache scale tensors, by last name part, and the scales each sets: K's and
V's (llm-compressor's ``<attention>.k_scale`` / ``.v_scale``; ModelOpt's
``<attention>.k_proj.k_scale`` / ``.v_proj.v_scale``; compressed-tensors'
``<attention>.k_proj.output_scale`` / ``.v_proj.output_scale``), or both at once (the older
single ``<attention>.kv_scale``), as vLLM reads them."""
PROJECTION_SCALES = {"k_proj": "k_scale", "v_proj": "v_scale"}
"""Whose scale a projection's ``output_scale`` is."""


def _load_kv_scale(model: nn.Module, names: CheckpointNames, name: str, tensor: Any) -> bool:
    """A checkpoint's per-tensor scale of an attention layer's cached K or V (KV_SCALE_NAMES)
    onto that layer's ``Attention`` (used by float8 caches only); an MLA layer's one latent
    cache takes K's scale, as in vLLM (V has no cache of its own there). False for any
    other tensor."""
    parent, _, which = name.rpartition(".")
    if which == "output_scale":
        which = PROJECTION_SCALES.get(parent.rpartition(".")[2], which)
    if which not in KV_SCALE_NAMES:
        return False
    attention = _attention_at(model, names.map(parent)[0])
    if attention is None:
        return False
    value = float(tensor if isinstance(tensor, torch.Tensor) else tensor[:])
    if not value > 0:
        raise ValueError(f"checkpoint tensor {name}: a KV cache scale must be > 0, got {value}")
    if isinstance(attention, MLAAttention):
        if which != "v_scale":
            attention.kv_scale = value
    else:
        for scale in KV_SCALE_NAMES[which]:
            setattr(attention, scale, value)
    return True


def _attention_at(model: nn.Module, path: str) -> Attention | MLAAttention | None:
    """The attention module in the module at ``path`` or, for a projection's scale
    (``self_attn.k_proj``), in its parent; None if neither holds one."""
    for candidate in (path, path.rpartition(".")[0]):
        try:
            module = model.get_submodule(candidate)
        except AttributeError:
            continue
        found = next((m for m in module.modules() if isinstance(m, (Attention, MLAAttention))), None)
        if found is not None:
            return found
    return None


def _keep_fp8_layers(model: nn.Module, path: Path, names: CheckpointNames,
                     block: tuple[int, int], fp4_experts: bool = False) -> set[str]:
    """Makes each linear layer and each stack of experts whose checkpoint tensors are all
    quantized (fp8; the experts MXFP4 with ``fp4_experts``) hold them as loaded
    (``GemmLayer.keep_fp8``, ``FusedExperts.keep_fp8`` / ``keep_fp4``); returns their weights'
    parameter names. A weight another module shares (a tied LM head) stays dense."""
    scaled: dict[str, int] = {}  # parameter -> how many of its checkpoint tensors have scales
    for name in map(fp8.canonical_name, _checkpoint_tensor_names(path)):
        if name.endswith(fp8.SCALE_SUFFIX):
            target = names.map(name.removesuffix(fp8.SCALE_SUFFIX))[0]
            scaled[target] = scaled.get(target, 0) + 1
    owners = weight_owners(model)
    kept = set()
    for name, m in model.named_modules():
        if (isinstance(m, GemmLayer) and owners[id(m.weight)] == 1
                and scaled.get(f"{name}.weight") == len(m.checkpoint_parts()) and m.keep_fp8(block)):
            kept.add(f"{name}.weight")
        elif isinstance(m, Engram) and scaled.get(f"{name}.embed.weight") == 1:
            m.keep_fp8()  # (V4.1's n-gram tables: fp8 rows, a scale per 32 of a row)
            kept.add(f"{name}.embed.weight")
        elif (isinstance(m, FusedExperts)
                and scaled.get(f"{name}.w13") == 2 * m.num_experts
                and scaled.get(f"{name}.w2") == m.num_experts
                and (m.keep_fp4() if fp4_experts else m.keep_fp8(block))):
            kept |= {f"{name}.w13", f"{name}.w2"}
    return kept


@dataclass(frozen=True)
class CheckpointNames:
    """How a checkpoint's tensor names map onto the model's parameters, as the model class
    declares it: ``packed`` (a projection loaded into a slice of a merged one: q_proj ->
    (qkv_proj, 0)), ``renames`` (module names spelled differently: block_sparse_moe -> mlp; a
    dotted key renames a run of parts: experts.down_proj -> experts.w2) and
    ``expert_weights`` (``experts.<e>.<proj>.weight`` -> a slice of a stacked expert tensor:
    w1 -> (w13, 0) loads with shard (e, 0)) and ``prefixes`` (whole name prefixes: DeepSeek's
    MTP layer ``model.layers.<n>.`` -> ``mtp.0.``)."""

    packed: dict[str, tuple[str, int]]
    renames: dict[str, str]
    expert_weights: dict[str, tuple[str, int]]
    prefixes: dict[str, str]

    def map(self, name: str) -> tuple[str, Any]:
        """(parameter name, shard or None) for a checkpoint tensor name."""
        for old, new in self.prefixes.items():
            if name.startswith(old):
                name = new + name[len(old):]
                break
        for old, new in self.renames.items():  # dotted renames: a run of parts
            if "." in old:
                name = re.sub(rf"(^|\.){re.escape(old)}(?=\.|$)", rf"\g<1>{new}", name)
        parts = [self.renames.get(p, p) for p in name.split(".")]
        for i in range(len(parts) - 3):
            if (parts[i] == "experts" and parts[i + 1].isdigit()
                    and parts[i + 3] in ("weight", "weight" + fp8.SCALE_SUFFIX)
                    and parts[i + 2] in self.expert_weights):
                stacked, part = self.expert_weights[parts[i + 2]]
                stacked += parts[i + 3].removeprefix("weight")  # an fp8 weight's scales: w13_scale_inv
                return ".".join([*parts[:i + 1], stacked]), (int(parts[i + 1]), part)
        for i, part in enumerate(parts):
            if part in self.packed:
                merged, shard = self.packed[part]
                return ".".join([*parts[:i], merged, *parts[i + 1:]]), shard
        return ".".join(parts), None


def _checkpoint_names(model: nn.Module, packed: dict[str, tuple[str, int]]) -> list[str]:
    """The Hugging Face names of the tensors ``model`` loads: each merged parameter
    (qkv_proj) under the names of its parts (q_proj, k_proj, v_proj)."""
    parts_of: dict[str, list[str]] = {}
    for part, (merged, _) in packed.items():
        parts_of.setdefault(merged, []).append(part)
    names = []
    for name in dict(model.named_parameters()):
        pieces = name.split(".")
        merged_at = next((i for i, p in enumerate(pieces) if p in parts_of), None)
        if merged_at is None:
            names.append(name)
            continue
        names.extend(".".join([*pieces[:merged_at], part, *pieces[merged_at + 1:]])
                     for part in parts_of[pieces[merged_at]])
    return names


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {str(path)!r}")
    return files


def _checkpoint_tensor_names(path: Path) -> list[str]:
    """Every tensor's name, from the files' headers (no tensor is read)."""
    names = []
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def _iter_checkpoint(path: Path, progress: bool, slices: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every tensor in the checkpoint; with ``slices``, safetensors slices
    instead, read when indexed (valid until the next item)."""
    files = _safetensors_files(path)
    for file in tqdm(files, desc="Loading safetensors shards", disable=not progress,
                     unit="shard"):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_slice(name) if slices else f.get_tensor(name)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors made inside are ``dtype`` unless told otherwise (a model built in its dtype)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
