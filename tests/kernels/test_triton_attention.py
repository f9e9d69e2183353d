"""Parity of the Triton attention backend with the torch reference backend.

Without a GPU the kernels run in Triton's interpreter on CPU tensors. ``triton.jit`` reads
``TRITON_INTERPRET`` when a function is *defined*, and in a full test run triton is already
imported (torch._dynamo imports it) before this module can set the variable, so
``use_interpreter`` re-defines triton.language's own jit helpers (tl.zeros, tl.max, tl.sum, ...)
and this project's kernels in interpreter mode. On a CUDA machine (``benchmarks/gpu_check.sh``)
the same cases run compiled, on the GPU.

Every case runs on an engine-like cache (a layer view of a block-major
``[num_blocks, layers, 2, bs, H, D]`` tensor, so the block dimension is strided) with shuffled
physical blocks, and q/k/v are strided views of one fused qkv projection. The reference reads a
clean cache; the Triton backend reads a copy in which every slot it must not read is NaN
(blocks nobody owns, the unused tail of last blocks) and whose block-table padding points at a
NaN block or far out of range, so one stray read turns its output NaN.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from attention_support import triton_test_device

DEVICE = triton_test_device()

from openinfer.attention import AttentionMetadata, select_attention_backend  # noqa: E402
from openinfer.attention.reference import TorchAttentionBackend  # noqa: E402
from openinfer.attention.triton import TritonAttentionBackend  # noqa: E402
from openinfer.kernels import triton_attention  # noqa: E402
from openinfer.kernels.kv_quant import quantize_kv  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
FAR = 2**30  # a block-table padding entry far past the cache


@dataclass
class Case:
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    block_size: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    clean: torch.Tensor
    """The reference's cache: earlier context where sequences have it, zeros elsewhere."""
    poisoned: torch.Tensor
    """The same context, NaN in every slot the step neither reads nor writes."""
    nan_block: int
    scale: float


def layer_view(storage: torch.Tensor) -> torch.Tensor:
    """Layer 1's [2, num_blocks, bs, H, D] view of a [num_blocks, layers, 2, bs, H, D] pool."""
    return storage[:, 1].transpose(0, 1)


def make_case(query_lens: list[int], seq_lens: list[int], *, heads: int = 4, kv_heads: int = 2,
              head_dim: int = 64, block_size: int = 16, dtype: torch.dtype = torch.float32,
              shared_blocks: int = 0, scale: float | None = None, seed: int = 0) -> Case:
    """Sequences with the given lengths; the first ``shared_blocks`` blocks of every sequence
    are the same physical blocks (one prefix-cache hit shared by all)."""
    gen = torch.Generator().manual_seed(seed)
    own = [-(-s // block_size) - shared_blocks for s in seq_lens]
    used = shared_blocks + sum(own)
    nan_block = used
    physical = torch.randperm(used, generator=gen).tolist()
    shared, nxt, tables = physical[:shared_blocks], shared_blocks, []
    for n in own:
        tables.append(shared + physical[nxt:nxt + n])
        nxt += n
    storage = torch.randn(used + 2, 3, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    context = torch.zeros(used + 2, block_size, dtype=torch.bool)  # slots holding earlier K/V
    for table, q_len, seq_len in zip(tables, query_lens, seq_lens):
        for pos in range(seq_len - q_len):
            context[table[pos // block_size], pos % block_size] = True
    hidden = ~context[:, None, None, :, None, None].expand_as(storage)
    clean, poisoned = storage.clone(), storage.clone()
    clean[hidden] = 0
    poisoned[hidden] = float("nan")
    tokens = sum(query_lens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.to(DEVICE).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    return Case(list(query_lens), list(seq_lens), tables, block_size,
                q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim),
                v.view(tokens, kv_heads, head_dim), layer_view(clean.to(DEVICE)),
                layer_view(poisoned.to(DEVICE)), nan_block,
                scale if scale is not None else 1 / math.sqrt(head_dim))


def pad_tables(meta: AttentionMetadata, case: Case) -> None:
    """Junk past each sequence's blocks (two extra columns too): a NaN block or far away."""
    tables = torch.cat([meta.block_tables, meta.block_tables[:, :2]], dim=1)
    for b, table in enumerate(case.tables):
        tables[b, len(table):] = case.nan_block if b % 2 else FAR
    meta.block_tables = tables


def check(case: Case, backend: TritonAttentionBackend | None = None) -> None:
    reference, triton_backend = TorchAttentionBackend(), backend or TritonAttentionBackend()
    metas = [b.build_metadata(case.query_lens, case.seq_lens, case.tables, case.block_size, DEVICE)
             for b in (reference, triton_backend)]
    pad_tables(metas[1], case)
    expected = reference.forward(case.q, case.k, case.v, case.clean, metas[0], case.scale)
    out = triton_backend.forward(case.q, case.k, case.v, case.poisoned, metas[1], case.scale)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert not out.isnan().any(), "the kernel read poisoned K/V or left rows unwritten"
    tol = TOLERANCE[case.q.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    # The step's K/V land in the same slots, bit for bit.
    slots = metas[0].slot_mapping
    written = [c.reshape(2, -1, *c.shape[3:])[:, slots] for c in (case.poisoned, case.clean)]
    assert torch.equal(*written)


def test_runs_where_expected():
    """Under the interpreter the kernels take CPU tensors (no GPU driver is involved)."""
    assert DEVICE == "cuda" or (triton_attention.interpreted() and
                                os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.parametrize("source,dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.bfloat16)], ids=["fp32", "bf16", "cast"])
def test_write_kv(source, dtype):
    """Exactly the mapped slots change, to k/v cast to the cache dtype; negative slots skip."""
    kv_heads, head_dim, block_size, blocks = 3, 80, 8, 6
    gen = torch.Generator().manual_seed(1)
    storage = torch.zeros(blocks, 2, 2, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    cache = layer_view(storage)
    slots = torch.tensor([9, 0, 47, 23, -1, 8], device=DEVICE)
    kv = torch.randn(len(slots), 2 * kv_heads * head_dim, generator=gen).to(DEVICE, source)
    k, v = (t.view(len(slots), kv_heads, head_dim) for t in kv.chunk(2, -1))  # strided views
    triton_attention.write_kv(cache, k, v, slots)
    flat = cache.reshape(2, blocks * block_size, kv_heads, head_dim)
    keep = slots >= 0
    for written, expected in ((flat[0, slots[keep]], k[keep]), (flat[1, slots[keep]], v[keep])):
        if source != dtype and DEVICE == "cpu":
            # The interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest, like torch).
            torch.testing.assert_close(written.float(), expected, atol=0, rtol=2**-7)
        else:
            assert torch.equal(written, expected.to(dtype))
    untouched = torch.ones(blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[keep]] = False
    assert not flat[:, untouched].any()
    assert not storage[:, 0].any(), "wrote into another layer"


@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_batch(group):
    seq_lens = [1, 15, 16, 17, 100]
    check(make_case([1] * len(seq_lens), seq_lens, heads=2 * group, kv_heads=2))


def test_prefill_without_cache():
    lens = [1, 7, 33, 70]
    check(make_case(lens, lens))


def test_chunked_prefill_and_prefix_hits():
    # Chunks starting mid-block, at a block boundary, and a long one over a longer context.
    check(make_case([5, 16, 40], [21, 48, 120], heads=8, kv_heads=2))
    # A prefix hit shared by all: 3 blocks (48 tokens) in common, decodes and chunks after it.
    check(make_case([1, 9, 30], [60, 70, 90], shared_blocks=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_mixed_batch(dtype):
    # Decodes, then a fresh prompt, a continuation and a prefix hit, with MQA-like grouping.
    check(make_case([1, 1, 1, 37, 12, 20], [50, 130, 3, 37, 80, 99], heads=8, kv_heads=1,
                    dtype=dtype))


@pytest.mark.parametrize("head_dim", [80, 128])
def test_head_dims_bf16(head_dim):
    check(make_case([1, 1, 21], [40, 9, 60], head_dim=head_dim, dtype=torch.bfloat16))


def test_peaky_softmax():
    # Scale 1: the running max is overtaken often, so the rescaling is exercised.
    check(make_case([1, 30], [70, 90], scale=1.0))


@pytest.mark.parametrize("block_size", [8, 24, 32])
def test_other_block_sizes(block_size):
    check(make_case([1, 1, 20], [5, 70, 50], block_size=block_size))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_kv_decode(dtype):
    # Three splits, each sequence's sized from its own length (at least one 64-key tile): the
    # short decodes leave later splits empty; 400 keys make splits of three tiles (192 keys).
    backend = TritonAttentionBackend(num_kv_splits=3)
    check(make_case([1, 1, 1], [1, 100, 170], heads=4, kv_heads=2, dtype=dtype), backend)
    check(make_case([1, 1, 30], [130, 60, 90], heads=6, kv_heads=2, dtype=dtype), backend)
    check(make_case([1, 1], [400, 70], heads=4, kv_heads=2, dtype=dtype), backend)


def test_plan_covers_every_prefill_token_once():
    plan = triton_attention.plan_attention([1, 1, 70, 5, 33], [9, 40, 70, 100, 60], 2, group=2,
                                           num_kv_heads=2, device="cpu")
    block_q = plan.prefill_block_q
    covered = [(int(s), t) for s, first in plan.prefill_tiles.T.tolist()
               for t in range(first, first + block_q)]
    lens = {2: 70, 3: 5, 4: 33}
    assert sorted(c for c in covered if c[1] < lens[c[0]]) == sorted(
        (s, t) for s, n in lens.items() for t in range(n))
    assert plan.prefill_tiles[0, 0] == 3  # the 100-key continuation starts first


def test_selector(monkeypatch, caplog):
    monkeypatch.delenv("OPENINFER_ATTENTION_BACKEND", raising=False)
    assert select_attention_backend("triton", DEVICE).name == "triton"
    assert select_attention_backend("auto", "cuda").name == "triton"
    monkeypatch.setattr(triton_attention, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="set after triton was imported"):
        select_attention_backend("triton", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on CUDA"):
        select_attention_backend("triton", "cpu")
    # Where triton cannot be imported, auto on CUDA falls back with one warning; by name it fails.
    monkeypatch.setitem(__import__("sys").modules, "openinfer.attention.triton", None)
    with caplog.at_level("WARNING", logger="openinfer.attention.selector"):
        assert select_attention_backend("auto", "cuda").name == "torch"
    assert len(caplog.records) == 1 and "cannot import triton" in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match="cannot import triton"):
        select_attention_backend("triton", "cuda")


@pytest.mark.slow
def test_kernels_compile_for_hopper():
    """Triton's real compiler (down to a cubin for sm_90) accepts every kernel variant the backend
    launches: the interpreter does not check what only a GPU build does (dot shapes and dtypes,
    layouts). Covered by the CUDA run itself on a GPU."""
    if DEVICE == "cuda":
        pytest.skip("on a GPU every test compiles the kernels for real")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_compile_check.py")
    result = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = result.stdout.splitlines()
    assert sum("_attention_kernel" in line for line in compiled) == 6, compiled
    assert any("SPLIT': True" in line for line in compiled) and len(compiled) == 10, compiled


@pytest.mark.parametrize("window,softcap,sinks", [(1, 0.0, False), (20, 0.0, False), (20, 5.0, True),
                                                  (0, 3.0, False), (0, 0.0, True)])
def test_window_softcap_and_sinks(window, softcap, sinks):
    # Decodes, a fresh prompt longer than the window and a continuation, with and without
    # split-KV; every slot before a sequence's window is NaN in the kernel's cache.
    gen = torch.Generator().manual_seed(3)
    sink = (torch.randn(8, generator=gen) * 2).to(DEVICE) if sinks else None
    for backend in (TritonAttentionBackend(), TritonAttentionBackend(num_kv_splits=3)):
        case = make_case([1, 1, 40, 12], [150, 9, 40, 80], heads=8, kv_heads=2)
        reference = TorchAttentionBackend()
        metas = [b.build_metadata(case.query_lens, case.seq_lens, case.tables, case.block_size,
                                  DEVICE) for b in (reference, backend)]
        bs = case.block_size
        for table, q_len, seq_len in zip(case.tables, case.query_lens, case.seq_lens):
            first = max(0, seq_len - q_len - window + 1) if window else 0
            for pos in range(first // bs * bs):  # whole blocks before the window
                case.poisoned[:, table[pos // bs], pos % bs] = float("nan")
        extra = dict(window=window, softcap=softcap, sinks=sink)
        expected = reference.forward(case.q, case.k, case.v, case.clean, metas[0], case.scale, **extra)
        out = backend.forward(case.q, case.k, case.v, case.poisoned, metas[1], case.scale, **extra)
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-5, rtol=2e-5)


def _float8_cache(cache: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float) -> torch.Tensor:
    """A case's cache stored as float8 (NaN poison stays NaN), in the same interleaved layout."""
    storage = torch.zeros(cache.shape[1], 3, *cache.shape[:1], *cache.shape[2:], dtype=dtype,
                          device=cache.device)
    view = layer_view(storage)
    view[0] = quantize_kv(cache[0], k_scale, dtype)
    view[1] = quantize_kv(cache[1], v_scale, dtype)
    return view


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("splits", [None, 3], ids=["planned", "split3"])
def test_float8_cache(cache_dtype, splits):
    """--kv-cache-dtype fp8: the write kernel stores kv_quant's bytes (scaled, clamped, rounded to
    nearest even), the attention widens float8 tiles to q's dtype with the per-tensor scales in
    the softmax scale and the output rows (split-KV merges included): the reference's result."""
    k_scale, v_scale = 0.05, 3.0
    backend, reference = TritonAttentionBackend(num_kv_splits=splits), TorchAttentionBackend()
    case = make_case([1, 1, 9, 40], [150, 17, 30, 80], heads=8, kv_heads=2)
    case.k[0, 0, :2] = torch.tensor([1e4, -1e4])  # past e4m3's range once scaled: clamped
    clean = _float8_cache(case.clean, cache_dtype, k_scale, v_scale)
    poisoned = _float8_cache(case.poisoned, cache_dtype, k_scale, v_scale)
    metas = [b.build_metadata(case.query_lens, case.seq_lens, case.tables, case.block_size, DEVICE)
             for b in (reference, backend)]
    pad_tables(metas[1], case)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    expected = reference.forward(case.q, case.k, case.v, clean, metas[0], case.scale, **scales)
    out = backend.forward(case.q, case.k, case.v, poisoned, metas[1], case.scale, **scales)
    assert not out.isnan().any(), "the kernel read poisoned K/V or left rows unwritten"
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    slots = metas[0].slot_mapping
    written = [c.reshape(2, -1, *c.shape[3:])[:, slots].view(torch.uint8) for c in (poisoned, clean)]
    assert torch.equal(*written)
