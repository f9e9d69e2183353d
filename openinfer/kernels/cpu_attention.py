"""Paged varlen attention on CPU: a C++ kernel (``cpu/paged_attention.cpp``) and its torch oracle.

One call per layer serves every sequence of a step — prefill, chunked-prefill continuation,
prefix-cache hit and decode — reading K/V blocks in place through the block table::

    tokens (q rows):  | d0 | d1 | p0 p0 p0 p0 | p1 p1 p1 |
    query_start_loc:  0    1    2             6          9
    p0 keys:          [ cached: prefix hit / earlier chunks | this chunk ]
                      0                           seq_len - q_len    seq_len

Query ``i`` of sequence ``b`` (``q_len`` rows) sits at position ``seq_len - q_len + i`` and
attends keys ``0 ..`` that position; key ``t`` lives in block ``block_tables[b, t // bs]``
at offset ``t % bs``. Table entries past ``ceil(seq_len / bs)`` are never read.

How the kernel splits the work (GQA packing, stacked rows over shared prefix blocks, split-KV,
online softmax in fp32) is described at the top of the C++ source. Beyond the contract, the
module has ``paged_attention(..., kv_splits=k)`` (force k KV splits per item; tests),
``paged_attention(..., invariant=True)`` (batch-invariant mode),
``plan_stats(...)`` (how a call would be split into items) and ``isa()``.

bf16 products: the many-row items of a bf16 cache (prefill tiles, shared-prefix passes) can
widen K/V to fp32 for FMAs (``fp32``), take VDPBF16PS dot products (``avx512_bf16``) or AMX
tiles (``amx_bf16``), as the build and the CPU allow (``bf16_dot_paths()``). Which is fastest
is the CPU's to say, not its flags' (VDPBF16PS doubles fp32 FMAs on Zen 5 and does not beat
them on Intel cores, where AMX does): ``choose_bf16_dot`` times them once per process on the
model's shape, unless ``OPENINFER_CPU_BF16_DOT`` names one.

The extension is compiled on first use (torch.utils.cpp_extension: a C++ compiler and ninja)
with ``-march=native`` into torch's extension cache (``~/.cache/torch_extensions`` or
``TORCH_EXTENSIONS_DIR``). Its name carries a hash of the CPU's ISA (``/proc/cpuinfo`` flags,
torch's CPU capability, torch version, flags, the sources), so machines with different CPUs
sharing that cache each get their own binary instead of an illegal instruction.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from openinfer.kernels.kv_quant import dequantize_kv

logger = logging.getLogger("openinfer.kernels.cpu_attention")

SOURCES = [Path(__file__).parent / "cpu" / name
           for name in ("bindings.cpp", "paged_attention.cpp", "rms_norm.cpp", "activation.cpp",
                        "rotary.cpp", "rope_attention.cpp", "small_gemm.cpp", "fused_moe.cpp", "amx_gemm.cpp",
                        "mkl_gemm.cpp", "token_mask.cpp", "write_kv.cpp", "decoder_layers.cpp",
                        "cache_control.cpp", "caching_allocator.cpp")]
"""The extension: paged attention and the write of a step's K/V into the cache, the RMSNorm,
rotary embedding and the gated MLP's SiLU-and-multiply the layers use with it, the three
chained in one call per layer (``RopeAttention``), a Llama-family model's decoder layers in one
call per step (``DecoderLayers``), the GEMMs the
GEMM planner may choose (few-row float32, AMX bf16, MKL-packed float32), a MoE layer's
routed experts in one call (``fused_moe``, openinfer/kernels/fused_moe.py), structured
outputs' token masking, and a caching allocator for torch's large CPU tensors."""
HEADERS = [Path(__file__).parent / "cpu" / name
           for name in ("vec.h", "amx.h", "attention_tiles.h", "attention_bf16.h", "attention_two_pass.h",
                        "paged_attention.h", "norm_rows.h", "fp8.h", "ops.h")]
"""Included by the sources (so they count in the build's cache key)."""
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-Wno-psabi")

_lock = threading.Lock()
_built: dict[str, ModuleType | None] = {}  # "native": the build for this CPU, or None if it failed

BF16_DOT_ENV = "OPENINFER_CPU_BF16_DOT"
_bf16_dot = ""
"""The bf16 product path every call takes ("": the build's default, VDPBF16PS where compiled)."""


def cpu_isa_tag() -> str:
    """A short name for this CPU's instruction set: torch's capability plus a hash of the
    feature flags (and of what else makes a binary incompatible)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86, ARM
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    # The sources' hash and place too: checkouts sharing the extension cache (a CI clone
    # beside a working tree) each keep their own build. torch's build file names the
    # sources by path, so two checkouts of the same code under one name would rebuild over
    # one another at every load (a minute of both cores each time).
    sources = hashlib.sha1(b"".join(p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()
    key = "|".join((flags, capability, platform.machine(), torch.__version__, " ".join(CFLAGS),
                    sources, str(SOURCES[0].parent.resolve())))
    return f"{capability.lower()}_{hashlib.sha1(key.encode()).hexdigest()[:10]}"


LANE_TWIN_SOURCES = [p for p in SOURCES if p.name in ("bindings.cpp", "paged_attention.cpp",
                                                    "rms_norm.cpp", "fused_moe.cpp",
                                                    "small_gemm.cpp")]
"""The sources whose code depends on the vector width (``OI_VEC_WIDTH``): all a lane twin
builds (its bindings stop at ``OI_LANE_TWIN``), a third of the compile of a whole build.
small_gemm.cpp's fp8 kernels also read e4m3 there without F16C, as CPUs without it do."""


def build_extension(extra_cflags: tuple[str, ...] = (), variant: str = "",
                    sources: list[Path] = SOURCES) -> ModuleType:
    """Compile (or load from torch's extension cache) the kernel; raises on failure.

    ``extra_cflags``/``variant``/``sources`` build a differently named twin (``build_lane_twin``).
    """
    from torch.utils import cpp_extension

    cpp_extension.verify_ninja_availability()
    name = f"openinfer_cpu_attention_{cpu_isa_tag()}" + (f"_{variant}" if variant else "")
    with _one_builder(name):
        return cpp_extension.load(
            name=name,
            sources=[str(p) for p in sources],
            extra_cflags=[*CFLAGS, *extra_cflags],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )


def build_lane_twin(native: ModuleType) -> ModuleType:
    """The vector-width code at the width this CPU's build does not use (8 floats where the
    native build has 16 and AVX-512 intrinsics; 16 elsewhere, vectors split in two), so that
    tests cover both on any CPU: paged attention, the norms, the fused MoE kernel and the fp8
    GEMM only."""
    width = 8 if native.isa().startswith("vec16") else 16
    return build_extension((f"-DOI_VEC_WIDTH={width}", "-DOI_LANE_TWIN"), f"w{width}",
                           LANE_TWIN_SOURCES)


@contextlib.contextmanager
def _one_builder(name: str):
    """One process at a time builds or loads ``name``, under an flock the kernel releases
    when its holder dies. torch's own lock file is left behind by a build that was killed
    (a server stopped during its first start), and every later load would wait on it
    forever; once we hold the flock, any such file is stale, and is removed."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        build_dir = Path(_get_build_directory(name, verbose=False))
    except Exception:  # (a private helper of torch's: without it, no stale-lock repair)
        yield
        return
    with open(build_dir / ".openinfer-builder.lock", "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def load_cpu_attention() -> ModuleType | None:
    """Build (torch.utils.cpp_extension.load, JIT, cached) and return the extension, or None
    with ONE logged warning if it cannot be built (no compiler, no ninja, build error).
    Cached per process: a failed build is never retried."""
    if "native" in _built:  # the hot path: no lock once decided
        return _built["native"]
    with _lock:
        if "native" not in _built:
            try:
                _built["native"] = build_extension()
            except Exception as exc:  # a missing compiler/ninja raises several types
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                # A compiler's output starts with its command line: show the first error instead.
                errors = [line for line in lines if "error:" in line]
                reason = (errors or lines or [type(exc).__name__])[0]
                logger.warning("CPU paged attention kernel unavailable: %s", reason[:500])
                _built["native"] = None
        return _built["native"]


def paged_attention(out: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    max_query_len: int, invariant: bool = False, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    bf16_dot: str | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> None:
    """out[T, Hq, D] = attention of q[T, Hq, D] over each sequence's paged K/V.

    key_cache / value_cache: [num_blocks, block_size, Hkv, D] — strided views: dim 0 has an
    arbitrary stride (the engine keeps every layer of a block together), but each block's
    [block_size, Hkv, D] is contiguous.
    block_tables: [B, max_blocks] int32 (padded; entries past a sequence's blocks are junk).
    query_start_loc: [B+1] int32 (sequence b's queries are rows query_start_loc[b]..[b+1]).
    seq_lens: [B] int32: cached + this step's tokens of sequence b. Query i of sequence b
    (0-based in its chunk, q_len = its row count) sits at position seq_len - q_len + i and
    attends keys 0 .. that position (causal with offset: a prefix hit or an earlier chunk is
    just a longer seq_len). Decode is q_len == 1. Its own K/V is already in the cache.
    GQA: Hq = Hkv * group. dtypes: float32 and bfloat16 (q and out share one dtype, the caches
    are of it or float8: e4m3fn or e5m2, whose entries read as stored value x ``k_scale`` /
    ``v_scale``, see openinfer/kernels/kv_quant.py; other caches ignore the scales; accumulate in
    fp32). head_dim a multiple of 16. Softmax scale given.
    ``invariant``: batch-invariant mode, each row's result bitwise independent of the other
    sequences and of how its own prompt was chunked (no split-KV, no shared-prefix items, one
    score path; slower for decode batches).
    Variants: ``window`` > 0, query ``p`` attends keys ``p - window + 1 .. p`` only (table entries
    before its window are never read); ``softcap`` > 0, each scaled score ``s`` becomes
    ``softcap * tanh(s / softcap)``; ``sinks`` [Hq], one logit per query head added to the
    softmax's denominator (a key with no value).
    ``bf16_dot``: the product path of a bf16 cache's many-row items (one of
    ``bf16_dot_paths()``; None: the process's choice, see ``choose_bf16_dot``).

    Raises RuntimeError if the extension could not be built (check ``load_cpu_attention()``
    first) and on malformed inputs (shapes, strides, block ids out of range).
    """
    module = load_cpu_attention()
    if module is None:
        raise RuntimeError("the CPU paged attention extension could not be built (see the log)")
    module.paged_attention(out, q, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                           float(scale), int(max_query_len), invariant=invariant, window=int(window),
                           softcap=float(softcap), sinks=sinks,
                           bf16_dot=_bf16_dot if bf16_dot is None else bf16_dot,
                           k_scale=float(k_scale), v_scale=float(v_scale))


def bf16_dot_paths() -> list[str]:
    """The bf16 product paths this CPU and build have: "fp32", then "avx512_bf16" and
    "amx_bf16" where compiled and usable; [] without the extension."""
    module = load_cpu_attention()
    return list(module.bf16_dot_paths()) if module is not None else []


def set_bf16_dot(path: str) -> None:
    """Every later call of this process takes ``path`` (one of ``bf16_dot_paths()``)."""
    global _bf16_dot
    if path not in bf16_dot_paths():
        raise ValueError(f"{BF16_DOT_ENV}/bf16_dot: {path!r} is not one of this CPU's "
                         f"paths {bf16_dot_paths()}")
    _bf16_dot = path


def choose_bf16_dot(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                    tokens: int = 256) -> dict[str, float]:
    """Set the process's bf16 product path to the fastest on this CPU: each path times a
    ``tokens``-token prefill of the model's attention shape (best of 3, a few ms each);
    ``OPENINFER_CPU_BF16_DOT`` names one instead. Returns the seconds per path timed
    ({} when forced or when there is one path); the choice is ``bf16_dot()``."""
    forced = os.environ.get(BF16_DOT_ENV, "")
    if forced:
        set_bf16_dot(forced)
        return {}
    paths = bf16_dot_paths()
    if len(paths) <= 1:
        return {}
    gen = torch.Generator().manual_seed(0)
    blocks = -(-tokens // block_size)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(torch.bfloat16)
    kv = torch.randn(2, blocks, block_size, num_kv_heads, head_dim,
                     generator=gen).to(torch.bfloat16)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([tokens], dtype=torch.int32)
    out = torch.empty_like(q)
    times = {}
    for path in paths:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            paged_attention(out, q, kv[0], kv[1], tables, qsl, lens, head_dim ** -0.5, tokens,
                            bf16_dot=path)
            best = min(best, time.perf_counter() - start)
        times[path] = best
    set_bf16_dot(min(times, key=times.get))
    return times


def bf16_dot() -> str:
    """The bf16 product path the process's calls take."""
    if _bf16_dot:
        return _bf16_dot
    paths = bf16_dot_paths()
    return "avx512_bf16" if "avx512_bf16" in paths else "fp32"


def paged_attention_reference(out: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, block_tables: torch.Tensor,
                              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                              max_query_len: int, window: int = 0, softcap: float = 0.0,
                              sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                              v_scale: float = 1.0) -> None:
    """The oracle for ``paged_attention`` (same contract): plain fp32 torch, one sequence at a
    time, an explicit causal (and window) mask with offset and an explicit softmax."""
    block_size = key_cache.shape[1]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        assert 0 <= q_len <= max_query_len and seq_len >= q_len
        if q_len == 0:
            continue
        # Blocks wholly before the first query's window are never read (they may be released).
        first = max(0, seq_len - q_len - window + 1) // block_size if window else 0
        blocks = block_tables[b, first:-(-seq_len // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len - first * block_size]  # [L, Hkv, D]
        v = value_cache[blocks].flatten(0, 1)[:seq_len - first * block_size]
        k, v = dequantize_kv(k, k_scale, torch.float32), dequantize_kv(v, v_scale, torch.float32)
        out[start:end] = masked_attention(q[start:end], k, v, scale, window, softcap, sinks,
                                          first * block_size).to(out.dtype)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                     key_offset: int = 0) -> torch.Tensor:
    """Plain fp32 attention of the last ``n`` positions of a sequence (q [n, Hq, D]) over its
    keys from position ``key_offset`` on (k, v [L, Hkv, D]): causal, with the optional window,
    soft cap and sinks of ``paged_attention``. Returns [n, Hq, D] in fp32."""
    n, num_heads = q.shape[0], q.shape[1]
    length, group = k.shape[0], num_heads // k.shape[1]
    kh = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    vh = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ kh.transpose(1, 2) * scale  # [Hq, n, L]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    positions = torch.arange(length - n, length, device=q.device)[:, None]
    keys = torch.arange(length, device=q.device)[None, :]
    hidden = keys > positions
    if window:
        hidden |= keys <= positions - window
    scores.masked_fill_(hidden, float("-inf"))
    if sinks is not None:  # a logit in the denominator with no value
        sink = sinks.float().view(num_heads, 1, 1).expand(num_heads, n, 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return (probs @ vh).transpose(0, 1)
