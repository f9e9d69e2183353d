"""GGUF files (llama.cpp's format) as checkpoints: config, weights and tokenizer metadata.

A GGUF holds a model's hyperparameters and tokenizer as metadata under llama.cpp's key names
(``llama.block_count``, ``tokenizer.ggml.tokens``, ...) and its tensors under llama.cpp's
names (``blk.0.attn_q.weight``), many of them quantized. This module turns the metadata into
the Hugging Face config dict the model classes read (``read_config``) and the tensors into
``(Hugging Face name, float32 array)`` pairs (``iter_tensors``), so the rest of the engine
treats a GGUF as one more checkpoint. Supported: ``ARCHITECTURES`` and ``SUPPORTED_TYPES``.

Two things llama.cpp's converter did are undone here:

* names: gguf's own ``TensorNameMap`` (HF name -> GGUF name), inverted over the names the
  model loads;
* q/k row order, for ``llama`` only: the converter reorders each head's rows so that rotary
  pairs are adjacent (dims 2i, 2i+1: the GPT-J layout llama.cpp's LLAMA rope rotates). Our
  rotary, like transformers', pairs dim i with i + head_dim/2 (NeoX), so the rows go back::

      stored (per head):  r0 r(h/2) r1 r(h/2+1) ...      ->     r0 r1 ... r(h/2) r(h/2+1) ...

  qwen2/qwen3 use the NeoX rope in llama.cpp and are stored unpermuted.

Llama 3's rope scaling has no metadata keys in a GGUF: the converter stores its per-frequency
divisors as a ``rope_freqs`` tensor. ``read_config`` recovers the ``llama3`` parameters from
them (and checks the recovered ones reproduce the tensor).

Every problem with a file (not a GGUF, truncated, unknown architecture, a quantization type
not supported, no tokenizer) is one ``ValueError`` naming the file.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from tqdm import tqdm

logger = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""GGUF ``general.architecture`` -> the model class (config.json ``architectures[0]``)."""

SUPPORTED_TYPES = frozenset({
    QType.F32, QType.F16, QType.BF16,
    QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
    QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K,
})
"""Tensor types we load (dequantized with gguf.quants): floats, legacy and K-quants. The
i-quants (IQ*), ternary (TQ*) and FP4 types are refused rather than loaded untested."""

_ROPE_FREQS = "rope_freqs.weight"


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and the problem."""


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """The parsed file (memory-mapped; cached per file version, since parsing a real model's
    tokenizer arrays takes seconds and config, weights and tokenizer each need it)."""
    path = Path(path)
    try:
        stat = path.stat()
        return _open_cached(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    except OSError as e:
        raise GGUFError(f"model: cannot read GGUF file {str(path)!r}: {e.strerror or e}") from None
    except _Invalid as e:
        raise GGUFError(f"model: not a valid GGUF file: {str(path)!r} ({e})") from None


class _Invalid(Exception):
    """What is wrong with a file that does not parse as GGUF (no file name: the caller adds it)."""


class _PlainMapReader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its memory map (the same bytes): numpy's
    memmap subclass runs Python bookkeeping (``__array_finalize__``) on every slice, and the
    reader slices once per string of the tokenizer's arrays, which made parsing SmolLM2's
    file take ~3 s."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:  # (the reader's __init__ assigns its memmap)
        self._plain_data = mapped.view(np.ndarray)


@functools.lru_cache(maxsize=4)
def _open_cached(resolved: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    try:
        reader = _PlainMapReader(resolved)
    except Exception as e:  # the reader raises whatever its parsing hits first
        raise _Invalid(f"truncated or corrupt: {_one_line(e)}") from None
    for tensor in reader.tensors:
        # A truncated file can still parse (the tensor views are cut short by the mmap).
        end = tensor.data_offset + tensor.n_bytes
        if end > size or tensor.data.nbytes != tensor.n_bytes:
            raise _Invalid(f"tensor {tensor.name!r} ends at byte {end}, the file has {size}: truncated?")
    if "general.architecture" not in reader.fields:
        raise _Invalid("no general.architecture in its metadata")
    return reader


def read_config(path: str | Path) -> dict:
    """The Hugging Face style config dict of a GGUF model (``architectures``, sizes, rope,
    ``eos_token_id`` as a list, ``torch_dtype``: the dtype ``auto`` means on CUDA).

    Raises GGUFError for an unreadable file, an architecture outside ``ARCHITECTURES``,
    missing hyperparameters, or a tensor type outside ``SUPPORTED_TYPES``.
    """
    reader = open_gguf(path)
    arch = _string(reader, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise GGUFError(f"model: {str(path)!r}: GGUF architecture {arch!r} is not supported; "
                        f"supported: {', '.join(ARCHITECTURES)}")
    _check_tensor_types(reader, path)

    def key(name: str, default: Any = _REQUIRED) -> Any:
        return _scalar(reader, f"{arch}.{name}", path, default)

    tensors = {t.name: t for t in reader.tensors}
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    # key_length is the head size when it is not hidden/heads (Qwen3); older llama files
    # state only the rotary width, which is the head size for full-rotary models.
    head_dim = key("attention.key_length", None) or key("rope.dimension_count", None) or hidden // heads
    theta = float(key("rope.freq_base", 10000.0))
    max_position = key("context_length")
    hf = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", None) or heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "max_position_embeddings": max_position,
        "vocab_size": _vocab_size(reader, arch, tensors),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": _scalar(reader, "tokenizer.ggml.bos_token_id", path, None),
        "eos_token_id": _eos_ids(reader, path),
        "torch_dtype": _dtype_name(reader),
    }
    scaling = _rope_scaling(reader, arch, path)
    if _ROPE_FREQS in tensors:
        scaling = _llama3_scaling(_dequantize(tensors[_ROPE_FREQS]), theta, head_dim, path)
    if scaling is not None:
        hf["rope_scaling"] = scaling
    return hf


def tokenizer_metadata_problem(path: str | Path) -> str | None:
    """Why this file's tokenizer cannot be built, or None if its metadata is there."""
    reader = open_gguf(path)
    missing = [k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if k not in reader.fields]
    if missing:
        return f"the GGUF file has no tokenizer (no {' or '.join(missing)} in its metadata)"
    return None


def tokenizer_model(path: str | Path) -> str | None:
    """``tokenizer.ggml.model``: 'gpt2' (byte-level BPE), 'llama' (sentencepiece), ..."""
    reader = open_gguf(path)
    if "tokenizer.ggml.model" not in reader.fields:
        return None
    return _string(reader, "tokenizer.ggml.model", path)


def chat_template(path: str | Path) -> str | None:
    """The file's ``tokenizer.chat_template`` (None when it has none)."""
    reader = open_gguf(path)
    if "tokenizer.chat_template" not in reader.fields:
        return None
    return _string(reader, "tokenizer.chat_template", path)


def iter_tensors(path: str | Path, hf_names: Iterable[str],
                 progress: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """``(hf_name, float32 array)`` for every tensor of the file that maps to one of
    ``hf_names`` (the un-merged Hugging Face names the model loads), in file order.

    Tensors are dequantized one at a time (peak extra memory: one float32 tensor). Tensors
    that map to none of ``hf_names`` are skipped with a warning (``rope_freqs`` silently: the
    config already holds it).
    """
    reader = open_gguf(path)
    hf = read_config(path)
    arch = _string(reader, "general.architecture", path)
    to_hf = _gguf_to_hf_names(arch, hf["num_hidden_layers"], hf_names)
    heads = {"attn_q": hf["num_attention_heads"], "attn_k": hf["num_key_value_heads"]}
    unused = []
    for tensor in tqdm(reader.tensors, desc="Loading GGUF tensors", disable=not progress, unit="tensor"):
        name = to_hf.get(tensor.name)
        if name is None:
            if tensor.name != _ROPE_FREQS:
                unused.append(tensor.name)
            continue
        data = _dequantize(tensor)
        kind = tensor.name.split(".")[-2]
        if arch == "llama" and kind in heads:
            data = _unpermute_rope_rows(data, heads[kind])
        yield name, data
    if unused:
        logger.warning("ignored %d GGUF tensors the model does not use, e.g. %s", len(unused), unused[:4])


# ----------------------------------------------------------------------------- tensors


def _gguf_to_hf_names(arch: str, num_layers: int, hf_names: Iterable[str]) -> dict[str, str]:
    """GGUF tensor name -> HF name, from gguf's HF -> GGUF map applied to ``hf_names``."""
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(model_arch, num_layers)
    out = {}
    for hf_name in hf_names:
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            out[gguf_name] = hf_name
    return out


def _dequantize(tensor: Any) -> np.ndarray:
    """The tensor as a writable float32 array in PyTorch's dim order (GGUF lists dims
    innermost first, so ``[576, 49152]`` is a 49152 x 576 matrix)."""
    # A plain ndarray view of the mmap: numpy's memmap subclass bookkeeping on every block
    # slice costs more than the dequantization itself.
    data = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    data = data.reshape(tuple(int(d) for d in reversed(tensor.shape)))
    if data.dtype != np.float32:
        data = data.astype(np.float32)
    # F32 comes back as a view of the read-only mmap; torch wants memory it may own.
    return data if data.flags.writeable and data.flags.c_contiguous else np.array(data, order="C")


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Back from llama.cpp's per-head row order (pairs interleaved) to HF's (halves)."""
    half = w.shape[0] // heads // 2
    return np.ascontiguousarray(w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _check_tensor_types(reader: gguf.GGUFReader, path: str | Path) -> None:
    bad = [t for t in reader.tensors if t.tensor_type not in SUPPORTED_TYPES]
    if bad:
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise GGUFError(
            f"model: {str(path)!r}: tensor {bad[0].name!r} has quantization type "
            f"{bad[0].tensor_type.name}, which is not supported{more}; supported: "
            f"{', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")


def _dtype_name(reader: gguf.GGUFReader) -> str:
    """The dtype ``auto`` picks on CUDA: the file's float type, bfloat16 for quantized files."""
    types = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    if types <= {QType.F32}:
        return "float32"
    if types <= {QType.F32, QType.F16}:
        return "float16"
    return "bfloat16"


def _vocab_size(reader: gguf.GGUFReader, arch: str, tensors: dict) -> int:
    if f"{arch}.vocab_size" in reader.fields:
        return int(_field_value(reader.fields[f"{arch}.vocab_size"]))
    if "tokenizer.ggml.tokens" in reader.fields:
        return len(reader.fields["tokenizer.ggml.tokens"].data)
    return int(tensors["token_embd.weight"].shape[-1])


def _eos_ids(reader: gguf.GGUFReader, path: str | Path) -> list[int]:
    """EOS plus llama.cpp's other end-of-generation ids (end of turn, end of message)."""
    ids = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _scalar(reader, f"tokenizer.ggml.{name}", path, None)
        if value is not None and value not in ids:
            ids.append(int(value))
    return ids


# ----------------------------------------------------------------------------- rope scaling


def _rope_scaling(reader: gguf.GGUFReader, arch: str, path: str | Path) -> dict | None:
    """``rope_scaling`` from ``{arch}.rope.scaling.*`` (linear, yarn; others reach get_rope,
    which names the types it supports)."""
    prefix = f"{arch}.rope.scaling."
    if prefix + "type" not in reader.fields:
        return None
    rope_type = _string(reader, prefix + "type", path)
    if rope_type == "none":
        return None
    factor = float(_scalar(reader, prefix + "factor", path))
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": factor}
    for gguf_key, hf_key in (("original_context_length", "original_max_position_embeddings"),
                             ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = _scalar(reader, prefix + gguf_key, path, None)
        if value is not None:
            scaling[hf_key] = value
    return scaling


def _llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int, path: str | Path) -> dict | None:
    """The ``llama3`` rope_scaling whose per-frequency divisors are ``divisors``.

    llama3 scaling keeps frequencies whose wavelength is under ``L / high_freq_factor``,
    divides those over ``L / low_freq_factor`` by ``factor``, and in between divides by
    ``1 / ((1 - s) / factor + s)`` with ``s = (L / wavelength - low) / (high - low)``.
    Only the two wavelength thresholds matter, so with ``low_freq_factor = 1`` the in-between
    divisors (s linear in 1 / wavelength) give ``L`` and ``high_freq_factor``.
    """
    divisors = divisors.astype(np.float64)
    if np.allclose(divisors, 1.0):
        return None
    factor = float(divisors.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    between = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    scaling = None
    if between.sum() >= 2:
        s = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[between], s, 1)  # s = slope / w + intercept
        high = 1 - 1 / intercept
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                   "high_freq_factor": float(high),
                   "original_max_position_embeddings": float(-slope / intercept)}
    if scaling is None or not np.allclose(_llama3_divisors(wavelen, scaling), divisors, rtol=1e-4):
        raise GGUFError(f"model: {str(path)!r}: its rope_freqs tensor is not llama3 rope scaling "
                        "(the only kind supported)")
    return scaling


def _llama3_divisors(wavelen: np.ndarray, scaling: dict) -> np.ndarray:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    s = np.clip((old_len / wavelen - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - s) / factor + s)


# ----------------------------------------------------------------------------- metadata


_REQUIRED: Any = object()


def _field_value(field: Any) -> Any:
    """A scalar or string field's value (gguf's parts/data layout, stable across versions)."""
    types = field.types
    if not types or types[0] == gguf.GGUFValueType.ARRAY:
        raise TypeError("an array")
    part = field.parts[field.data[0]]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


def _scalar(reader: gguf.GGUFReader, key: str, path: str | Path, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise GGUFError(f"model: {str(path)!r}: the GGUF metadata has no {key}")
        return default
    try:
        return _field_value(field)
    except (TypeError, IndexError, UnicodeDecodeError):
        raise GGUFError(f"model: {str(path)!r}: GGUF metadata {key} is not a single value "
                        "(per-layer values are not supported)") from None


def _string(reader: gguf.GGUFReader, key: str, path: str | Path) -> str:
    return str(_scalar(reader, key, path))


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."
