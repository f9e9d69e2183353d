"""Parity of the CPU paged attention kernel with its torch oracle.

Every case reads an engine-like cache (a layer view of a block-major
``[num_blocks, layers, 2, bs, H, D]`` tensor, so dim 0 is strided), with the physical blocks
shuffled. Whatever a sequence must not read is poisoned: blocks no sequence owns, block-table
padding (pointing at a NaN block or far out of range) and the unused tail of a last block are
NaN, so one stray read turns the output NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from openinfer.kernels.cpu_attention import (
    build_lane_twin,
    load_cpu_attention,
    paged_attention,
    paged_attention_reference,
)
from openinfer.kernels.kv_quant import quantize_kv


@pytest.fixture(scope="module")
def ext():
    module = load_cpu_attention()
    if module is None:
        pytest.skip("the CPU attention extension could not be built "
                    "(see the 'openinfer.kernels.cpu_attention' warning)")
    return module


@dataclass
class Batch:
    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    max_query_len: int
    kv_scales: dict = field(default_factory=dict)
    """k_scale and v_scale of a float8 cache (none for the others)."""

    def args(self, out: torch.Tensor) -> tuple:
        return (out, self.q, self.key_cache, self.value_cache, self.block_tables, self.query_start_loc,
                self.seq_lens, self.scale, self.max_query_len)


def make_batch(query_lens: list[int], seq_lens: list[int], *, heads: int = 4, kv_heads: int = 2,
               head_dim: int = 64, block_size: int = 16, dtype: torch.dtype = torch.float32,
               shared_blocks: int = 0, scale: float | None = None, layers: int = 3,
               contiguous: bool = False, seed: int = 0, cache_dtype: torch.dtype | None = None,
               k_scale: float = 1.0, v_scale: float = 1.0) -> Batch:
    """Sequences b = 0.. with the given lengths; the first ``shared_blocks`` blocks of every
    sequence are the same physical blocks (a prefix-cache hit shared by all). ``cache_dtype``:
    a float8 cache, its K and V stored with ``k_scale`` and ``v_scale`` as the engine stores
    them (poison included: NaN, or e4m3's largest value where a NaN reads as a number)."""
    gen = torch.Generator().manual_seed(seed)
    own = [-(-s // block_size) - shared_blocks for s in seq_lens]
    assert min(own) >= 0
    used = shared_blocks + sum(own)
    num_blocks = used + 3  # + blocks nobody owns
    nan_block = used  # an unowned block that padding points at
    stored = dtype if cache_dtype is None else torch.float32
    if contiguous:
        blocks = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(stored)
        key_cache, value_cache = blocks
    else:
        blocks = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=gen).to(stored)
        key_cache, value_cache = blocks[:, layers // 2].transpose(0, 1)
    physical = torch.randperm(used, generator=gen).tolist()
    shared, nxt = physical[:shared_blocks], shared_blocks
    width = max(shared_blocks + n for n in own) + 2
    tables = torch.empty(len(seq_lens), width, dtype=torch.int32)
    owned = set()
    for b, n in enumerate(own):
        row = shared + physical[nxt:nxt + n]
        nxt += n
        pad = nan_block if b % 2 else 2**30  # junk entries: a NaN block, or far out of range
        tables[b] = torch.tensor(row + [pad] * (width - len(row)), dtype=torch.int32)
        owned.update(row)
        tail = seq_lens[b] % block_size  # slots past the sequence in its last block
        if tail:
            key_cache[row[-1], tail:] = float("nan")
            value_cache[row[-1], tail:] = float("nan")
    for block in set(range(num_blocks)) - owned:
        key_cache[block] = float("nan")
        value_cache[block] = float("nan")
    if shared_blocks:  # the shared blocks must be full and visible to every query
        assert all(s - q >= shared_blocks * block_size for q, s in zip(query_lens, seq_lens))
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), heads, head_dim, generator=gen).to(dtype)
    kv_scales = {}
    if cache_dtype is not None:
        kv_scales = dict(k_scale=k_scale, v_scale=v_scale)
        if cache_dtype == torch.float8_e4m3fn:  # its NaN reads as a number: poison is its largest
            blocks.nan_to_num_(nan=448 * max(k_scale, v_scale))
        quantized = torch.empty_like(blocks, dtype=cache_dtype)
        for i, half_scale in enumerate((k_scale, v_scale)):
            index = (i,) if contiguous else (slice(None), slice(None), i)
            quantized[index] = quantize_kv(blocks[index], half_scale, cache_dtype)
        key_cache, value_cache = quantized if contiguous else quantized[:, layers // 2].transpose(0, 1)
    return Batch(q, key_cache, value_cache, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32),
                 scale if scale is not None else 1 / math.sqrt(head_dim), max(query_lens), kv_scales)


def plan(ext, batch: Batch, threads: int = 2, kv_splits: int = 0) -> tuple[int, int, int]:
    """(items, shared-prefix items, partial items) of the kernel's plan for this batch."""
    kv_heads, block_size = batch.key_cache.shape[2], batch.key_cache.shape[1]
    return ext.plan_stats(batch.block_tables, batch.query_start_loc, batch.seq_lens, kv_heads,
                          batch.q.shape[1] // kv_heads, block_size, threads, kv_splits)


def check(batch: Batch, run=None) -> None:
    ref = torch.full_like(batch.q, float("nan"))
    paged_attention_reference(*batch.args(ref), **batch.kv_scales)
    assert not ref.isnan().any(), "the oracle read poisoned K/V"
    out = torch.full_like(batch.q, float("nan"))
    (run or paged_attention)(*batch.args(out), **batch.kv_scales)
    assert not out.isnan().any(), "the kernel read poisoned K/V or left rows unwritten"
    if batch.q.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_batch(ext, dtype, head_dim, group):
    seq_lens = [1, 15, 16, 17, 64, 100, 333]
    check(make_batch([1] * len(seq_lens), seq_lens, heads=2 * group, kv_heads=2, head_dim=head_dim,
                     dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [0, 3])
def test_multi_token_decode_items_take_every_head(ext, dtype, splits):
    # 1-4 new tokens per sequence (speculative verification) over 8 KV heads of group 2: each
    # sequence is one item of all 8 heads (rows ordered head, token, member; causal within),
    # whole or split along its blocks into partial results.
    batch = make_batch([1, 2, 3, 4], [40, 77, 130, 260], heads=16, kv_heads=8, dtype=dtype)
    items, _, partial = plan(ext, batch, kv_splits=splits)
    if splits:
        assert items == partial == 4 * splits
    else:  # one item per sequence, the longest ones split to balance 2 threads (not per head: 32)
        assert 4 <= items < 16
    check(batch, lambda *args: ext.paged_attention(*args, kv_splits=splits))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 2, 8])
def test_prefill_without_cache(ext, dtype, group):
    lens = [1, 7, 16, 33, 100, 150]
    check(make_batch(lens, lens, heads=2 * group, kv_heads=2, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_chunked_continuation(ext, dtype, head_dim):
    # Chunks starting mid-block, at a block boundary, and a long one over a long context.
    check(make_batch([5, 16, 40, 70], [21, 48, 200, 300], head_dim=head_dim, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_prefix_hit_shared_by_several_sequences(ext, dtype):
    # Four sequences share their first 5 blocks (80 tokens): two decodes, two chunks after the hit.
    batch = make_batch([1, 1, 9, 30], [90, 97, 100, 130], shared_blocks=5, heads=8, kv_heads=2, dtype=dtype)
    check(batch)
    # Long prefills over a shared prefix gain nothing from stacking: each reads the prefix itself.
    batch = make_batch([64] * 4, [1088] * 4, shared_blocks=64, heads=4, kv_heads=2, dtype=dtype)
    assert plan(ext, batch)[1] == 0
    check(batch)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 2, 8])
def test_many_decodes_over_one_prefix(ext, dtype, group):
    # The W3 shape, small: every sequence's rows are stacked against the shared blocks.
    seq_lens = [70 + 3 * i for i in range(12)]
    batch = make_batch([1] * 12, seq_lens, shared_blocks=4, heads=2 * group, kv_heads=2, dtype=dtype)
    items, shared, partial = plan(ext, batch)
    # The 12 stacked rows of each KV head in tiles of 64 rows (8 tokens of 8 heads); all merged.
    assert shared == 2 * -(-12 // (64 // group)) and partial == items
    check(batch)


def test_partly_shared_prefixes(ext):
    split = lambda *args: ext.paged_attention(*args, kv_splits=3)
    # A tree of prefixes: all eight sequences share blocks 0-1; 0-3 and 6 also share blocks 2-5
    # (sequence 3 has only 4 blocks): the sequences only agree on 2 blocks.
    batch = make_batch([1, 1, 1, 1, 1, 1, 40, 1], [100, 110, 120, 60, 90, 95, 100, 200], shared_blocks=2)
    tables = batch.block_tables
    for b, end in ((1, 6), (2, 6), (3, 4), (6, 6)):
        tables[b, 2:end] = tables[0, 2:end]
    assert plan(ext, batch)[1] > 0
    check(batch)
    check(batch, split)
    # All agree on 4 blocks, but the prefill chunk (40 queries after 60 tokens) and the 60-token
    # decode see only 3 full blocks before their first query: 3 are shared.
    batch = make_batch([1, 1, 1, 1, 40], [100, 110, 120, 60, 100], shared_blocks=2)
    tables = batch.block_tables
    for b, end in ((1, 6), (2, 6), (3, 4), (4, 6)):
        tables[b, 2:end] = tables[0, 2:end]
    check(batch)
    check(batch, split)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [None, 1.0], ids=["scaled", "peaky"])
def test_mixed_decode_and_prefill(ext, dtype, scale):
    # Decodes first, then a fresh prompt, a continuation and a prefix hit; scale 1.0 makes the
    # softmax peaky, so its running maximum is rescaled often.
    check(make_batch([1, 1, 1, 37, 12, 64], [50, 260, 3, 37, 140, 99], heads=16, kv_heads=8,
                     dtype=dtype, scale=scale))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_kv(ext, dtype, splits):
    # Forced splits of every item: batch-1 decode, and a mixed batch whose first split holds keys
    # that the first rows of a prefill tile cannot see (their partials are empty).
    run = lambda *args: ext.paged_attention(*args, kv_splits=splits)
    check(make_batch([1], [1000], heads=16, kv_heads=8, dtype=dtype), run)
    check(make_batch([1, 20, 50], [300, 180, 50], dtype=dtype), run)


def test_split_kv_automatic_for_batch1_decode(ext):
    # One sequence and one KV head is one work item: with 2 threads the kernel splits its KV range.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dtype in DTYPES:
            batch = make_batch([1], [777], heads=4, kv_heads=1, dtype=dtype)
            assert plan(ext, batch)[2] >= 2
            check(batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("block_size", [8, 24, 32, 128])
def test_other_block_sizes(ext, block_size):
    check(make_batch([1, 1, 20, 33], [5, 300, 20, 290], block_size=block_size))


def test_contiguous_cache(ext):
    check(make_batch([1, 3, 40], [70, 3, 120], contiguous=True, dtype=torch.bfloat16))


def test_empty_query_sequences_are_skipped(ext):
    check(make_batch([0, 1, 0, 5], [10, 20, 30, 40]))


BF16_CASES = {
    # rows per KV head not a multiple of 16 (a tile's last rows), GQA groups 1, 2 and 8
    "prefill": dict(query_lens=[37, 5, 100], seq_lens=[37, 5, 100], heads=16, kv_heads=8),
    "prefill_mha": dict(query_lens=[70], seq_lens=[70], heads=4, kv_heads=4),
    "prefill_group8": dict(query_lens=[45], seq_lens=[45], heads=8, kv_heads=1),
    # continuations, with a chunk of keys of an odd number of blocks (padded to 32 keys)
    "chunks": dict(query_lens=[20, 33, 3], seq_lens=[500, 81, 300], heads=16, kv_heads=8),
    "cascade": dict(query_lens=[1] * 32, seq_lens=[1088] * 32, heads=16, kv_heads=8,
                    shared_blocks=64),
    "head_dim_128": dict(query_lens=[40, 1], seq_lens=[140, 77], head_dim=128),
    "head_dim_80": dict(query_lens=[40, 1], seq_lens=[140, 77], head_dim=80),  # not 32 x k
    "block_size_8": dict(query_lens=[40, 17], seq_lens=[90, 17], block_size=8),
    "block_size_48": dict(query_lens=[40, 17], seq_lens=[90, 17], block_size=48),  # 48-key chunks
    "block_size_128": dict(query_lens=[40, 17], seq_lens=[300, 17], block_size=128),
}


@pytest.mark.parametrize("path", ["fp32", "avx512_bf16", "amx_bf16"])
@pytest.mark.parametrize("case", list(BF16_CASES))
def test_every_bf16_product_path(ext, path, case):
    # Each path the CPU has (widened to fp32, VDPBF16PS, AMX tiles) against the oracle, on the
    # many-row items it serves (and the decode rows beside them), whatever the engine chose.
    if path not in ext.bf16_dot_paths():
        pytest.skip(f"this CPU/build has no {path} path")
    batch = make_batch(**BF16_CASES[case], dtype=torch.bfloat16)
    check(batch, lambda *args: paged_attention(*args, bf16_dot=path))
    # Batch-invariant mode takes the build's default path whatever is asked (and stays right).
    out = torch.full_like(batch.q, float("nan"))
    ext.paged_attention(*batch.args(out), invariant=True, bf16_dot=path)
    default = torch.full_like(batch.q, float("nan"))
    ext.paged_attention(*batch.args(default), invariant=True)
    assert torch.equal(out, default)
    ref = torch.empty_like(batch.q)
    paged_attention_reference(*batch.args(ref))
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("splits", [0, 3], ids=["planned", "split3"])
@pytest.mark.parametrize("path", ["avx512_bf16", "amx_bf16"])
def test_two_pass_items(ext, path, splits):
    # The bf16 paths' two-pass items (run_item_two_pass): groups of 32 and 16 rows and a padded
    # last AMX group, forced KV splits whose first part holds keys that a tile's first rows
    # cannot see (empty partials), a peaky softmax (scale 1), a prompt sharing its prefix blocks
    # with others, and an item over more keys than the two-pass buffers take (the online path).
    if path not in ext.bf16_dot_paths():
        pytest.skip(f"this CPU/build has no {path} path")
    run = lambda *args: ext.paged_attention(*args, kv_splits=splits, bf16_dot=path)
    for kwargs in (dict(query_lens=[20, 50, 64, 9], seq_lens=[300, 180, 64, 9], scale=1.0),
                   dict(query_lens=[64, 64, 40], seq_lens=[1088, 1088, 1064], shared_blocks=64),
                   dict(query_lens=[24, 1], seq_lens=[4200, 4200], kv_heads=2, heads=4)):
        check(make_batch(**{"heads": 16, "kv_heads": 8, **kwargs}, dtype=torch.bfloat16), run)


def test_unknown_bf16_product_path_is_refused(ext):
    batch = make_batch([3], [3], dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16_dot 'vnni' is not a path"):
        paged_attention(*batch.args(torch.empty_like(batch.q)), bf16_dot="vnni")


def test_the_fastest_bf16_path_is_chosen_by_timing(ext, monkeypatch):
    from openinfer.kernels import cpu_attention

    monkeypatch.setattr(cpu_attention, "_bf16_dot", "")
    times = cpu_attention.choose_bf16_dot(16, 8, 64, 16)
    paths = ext.bf16_dot_paths()
    assert set(times) == (set(paths) if len(paths) > 1 else set())
    if times:
        assert cpu_attention.bf16_dot() == min(times, key=times.get)
    monkeypatch.setenv(cpu_attention.BF16_DOT_ENV, "fp32")
    assert cpu_attention.choose_bf16_dot(16, 8, 64, 16) == {}
    assert cpu_attention.bf16_dot() == "fp32"
    monkeypatch.setenv(cpu_attention.BF16_DOT_ENV, "vnni")
    with pytest.raises(ValueError, match="'vnni' is not one of this CPU's paths"):
        cpu_attention.choose_bf16_dot(16, 8, 64, 16)


def test_rejects_bad_inputs(ext):
    batch = make_batch([1, 4], [20, 40])
    out = torch.empty_like(batch.q)
    batch.block_tables[1, 1] = 10**6  # a block the sequence reads
    with pytest.raises(RuntimeError, match="out of range"):
        paged_attention(*batch.args(out))
    batch = make_batch([1, 4], [20, 40])
    with pytest.raises(RuntimeError, match="dtype"):
        paged_attention(out, batch.q.bfloat16(), *batch.args(out)[2:])
    with pytest.raises(RuntimeError, match="max_query_len"):
        paged_attention(*batch.args(out)[:-1], 2)
    batch.seq_lens[1] = 3  # shorter than its 4 queries
    with pytest.raises(RuntimeError, match="seq_len"):
        paged_attention(*batch.args(out))


@pytest.mark.slow
def test_other_lane_width_build(ext):
    """The vector width this CPU's native build does not use (8 floats on AVX-512, where the
    native build has 16 and its intrinsics; 16 elsewhere, vectors split in two): the same
    source must compute the same attention and norms at either width."""
    native16 = ext.isa().startswith("vec16")
    other = build_lane_twin(ext)
    assert other.isa().startswith("vec8" if native16 else "vec16")
    for dtype in DTYPES:
        run = other.paged_attention
        check(make_batch([1, 1, 9, 70], [90, 333, 100, 170], shared_blocks=5, heads=8, kv_heads=2,
                         dtype=dtype), run)
        check(make_batch([1, 5, 64], [17, 5, 300], heads=16, kv_heads=2, head_dim=128, dtype=dtype), run)
        check(make_batch([1], [1000], heads=16, kv_heads=8, dtype=dtype),
              lambda *args: other.paged_attention(*args, kv_splits=3))
        for cache_dtype in FP8:  # float8 caches: e4m3 and e5m2 read without F16C
            check(make_batch([1, 1, 9, 70], [90, 333, 100, 170], shared_blocks=5, heads=8, kv_heads=2,
                             dtype=dtype, cache_dtype=cache_dtype, k_scale=0.05, v_scale=3.0), run)
        x = torch.randn(37, 200, dtype=dtype)
        weight = torch.randn(200, dtype=dtype)
        out, native = torch.empty_like(x), torch.empty_like(x)
        other.rms_norm(out, x, weight, 1e-6)
        ext.rms_norm(native, x, weight, 1e-6)
        torch.testing.assert_close(out, native)


def test_failed_build_warns_once_and_is_not_retried(monkeypatch, caplog):
    from openinfer.kernels import cpu_attention

    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.setattr(cpu_attention, "_built", {})
    monkeypatch.setattr(cpu_attention, "build_extension", broken)
    with caplog.at_level("WARNING", logger="openinfer.kernels.cpu_attention"):
        assert load_cpu_attention() is None
        assert load_cpu_attention() is None
    assert len(calls) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "CPU paged attention kernel unavailable: Ninja is required to load C++ extensions"]
    with pytest.raises(RuntimeError, match="could not be built"):
        paged_attention(*make_batch([1], [5]).args(torch.empty(1, 4, 64)))


def poison_before_windows(batch: Batch, window: int) -> None:
    """NaN in every block wholly before the window of a sequence's first query: the kernel
    must never read them (the KV manager releases them)."""
    block_size = batch.key_cache.shape[1]
    lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    for b, (q_len, seq_len) in enumerate(zip(lens, batch.seq_lens.tolist())):
        first = max(0, seq_len - q_len - window + 1) // block_size
        for block in batch.block_tables[b, :first].tolist():
            batch.key_cache[block] = float("nan")
            batch.value_cache[block] = float("nan")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [1, 5, 16, 40, 1000])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("sinks", [False, True])
def test_sliding_window_softcap_and_sinks(ext, dtype, window, softcap, sinks):
    # Decodes, a fresh prompt longer than the window, a continuation; blocks before each
    # sequence's windows are NaN. Forced splits put rows whose window misses a whole split.
    batch = make_batch([1, 1, 1, 70, 12, 30], [50, 260, 3, 70, 140, 99], heads=8, kv_heads=2,
                       dtype=dtype, scale=0.5)
    poison_before_windows(batch, window)
    sink = torch.randn(8) * 2 if sinks else None
    extra = dict(window=window, softcap=softcap, sinks=sink)
    ref = torch.full_like(batch.q, float("nan"))
    paged_attention_reference(*batch.args(ref), **extra)
    assert not ref.isnan().any()
    for splits in (0, 3):
        out = torch.full_like(batch.q, float("nan"))
        ext.paged_attention(*batch.args(out), kv_splits=splits, **extra)
        assert not out.isnan().any()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    if window >= 1000 and not softcap and not sinks:  # the plain kernel's answer
        plain = torch.empty_like(batch.q)
        paged_attention(*batch.args(plain))
        torch.testing.assert_close(plain.float(), ref.float(), atol=tol, rtol=tol)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_CASES = {
    "decodes": dict(query_lens=[1, 1, 1], seq_lens=[90, 333, 17], heads=8, kv_heads=2),
    "prefill+prefix": dict(query_lens=[1, 9, 70], seq_lens=[90, 100, 170], shared_blocks=5, heads=8,
                           kv_heads=2),
    "mha-128": dict(query_lens=[1, 5, 64], seq_lens=[17, 5, 300], heads=4, kv_heads=4, head_dim=128),
}


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(FP8_CASES))
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 3.0), (0.004, 0.5)],
                         ids=["unscaled", "scaled", "clamped"])
def test_float8_cache(ext, cache_dtype, dtype, case, scales):
    """A float8 cache (--kv-cache-dtype) with fp32 or bf16 queries, its per-tensor scales folded
    into the kernel's softmax scale and output rows: the oracle's dequantized attention. The
    "clamped" scales store keys past e4m3's largest value (clamped, as the engine writes them)."""
    k_scale, v_scale = scales
    check(make_batch(**FP8_CASES[case], dtype=dtype, cache_dtype=cache_dtype, k_scale=k_scale,
                     v_scale=v_scale))


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_float8_cache_variants_splits_and_invariant_mode(ext, cache_dtype):
    """Window, soft cap and sinks; forced KV splits (partial rows merged, each scaled once); the
    batch-invariant mode's transposed path for every item."""
    batch = make_batch([1, 7, 40], [200, 60, 40], heads=8, kv_heads=2, cache_dtype=cache_dtype,
                       k_scale=0.5, v_scale=2.0)
    sinks = torch.randn(8)

    def variants(*args, **kwargs):
        paged_attention(*args, window=24, softcap=5.0, sinks=sinks, **kwargs)

    def reference(*args, **kwargs):
        paged_attention_reference(*args, window=24, softcap=5.0, sinks=sinks, **kwargs)

    ref = torch.empty_like(batch.q)
    reference(*batch.args(ref), **batch.kv_scales)
    out = torch.empty_like(batch.q)
    variants(*batch.args(out), **batch.kv_scales)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    check(batch, lambda *args, **kw: load_cpu_attention().paged_attention(*args, kv_splits=3, **kw))
    check(batch, lambda *args, **kw: paged_attention(*args, invariant=True, **kw))


def test_kv_scales_apply_to_float8_caches_only(ext):
    """A checkpoint's k/v scales reach every layer whatever the cache: a cache that is not float8
    ignores them (as kv_quant's reference does). A bf16 cache under fp32 queries is refused."""
    batch = make_batch([1, 9], [20, 30])
    plain, scaled = torch.empty_like(batch.q), torch.empty_like(batch.q)
    paged_attention(*batch.args(plain))
    paged_attention(*batch.args(scaled), k_scale=2.0, v_scale=0.5)
    assert torch.equal(plain, scaled)
    half = make_batch([1], [20], dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="share one dtype"):
        paged_attention(torch.empty(1, 4, 64), half.q.float(), half.key_cache, half.value_cache,
                        *half.args(None)[4:])


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_write_kv_into_a_float8_cache_is_the_reference_quantization(ext, cache_dtype, dtype):
    """The C++ write's scale, clamp and round-to-nearest-even are quantize_kv's bit for bit,
    outliers (clamped) and values between two float8 numbers included."""
    blocks, block_size, kv_heads, head_dim = 6, 4, 2, 16
    gen = torch.Generator().manual_seed(5)
    cache = torch.zeros(2, blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
    slots = torch.tensor([9, 0, 23, 4])
    k = (torch.randn(4, kv_heads, head_dim, generator=gen) * 300).to(dtype)
    v = torch.randn(4, kv_heads, head_dim, generator=gen).to(dtype)
    k[0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, -0.0])
    ext.write_kv(cache, k, v, slots, k_scale=0.7, v_scale=0.01)
    expected = torch.zeros_like(cache)
    for half, x, scale in zip(expected, (k, v), (0.7, 0.01)):
        half.view(-1, kv_heads, head_dim)[slots] = quantize_kv(x, scale, cache_dtype)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [False, True], ids=["interleaved", "plain"])
def test_write_kv_fills_exactly_the_mapped_slots(dtype, contiguous):
    """The row-copy write (through a view of the layer as rows) against index_put_ with
    (block, offset) indices, on the engine's interleaved page layout and a plain cache."""
    from openinfer.kernels.paged_attention import write_kv

    blocks, layers, block_size, kv_heads, head_dim = 7, 3, 4, 2, 8
    gen = torch.Generator().manual_seed(3)
    if contiguous:
        storage = torch.zeros(2, blocks, block_size, kv_heads, head_dim, dtype=dtype)
        cache = storage
    else:  # every layer of a block together: layer 1's view is strided by the page
        storage = torch.zeros(blocks, layers, 2, block_size, kv_heads, head_dim, dtype=dtype)
        cache = storage[:, 1].transpose(0, 1)
    slots = torch.tensor([27, 0, 5, 13, 3, 22])
    kv = torch.randn(len(slots), 2 * kv_heads * head_dim, generator=gen)
    k, v = (t.view(len(slots), kv_heads, head_dim) for t in kv.chunk(2, -1))  # strided, fp32
    write_kv(cache, k, v, slots)
    expected = torch.zeros_like(storage)
    view = expected if contiguous else expected[:, 1].transpose(0, 1)
    for half, x in zip(view, (k, v)):
        half.index_put_((slots // block_size, slots % block_size), x.to(dtype))
    assert torch.equal(storage, expected)  # other layers and slots untouched


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load():
    """torch's build lock, left behind when a build is killed, would make every later load
    wait forever: a fresh process loads the kernel anyway and removes it."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    from openinfer.kernels.cpu_attention import build_extension, cpu_isa_tag

    build_extension()
    lock = Path(_get_build_directory(f"openinfer_cpu_attention_{cpu_isa_tag()}", False)) / "lock"
    lock.touch()  # what a build killed midway leaves
    loaded = subprocess.run([sys.executable, "-c", "from openinfer.kernels.cpu_attention "
                             "import build_extension; build_extension()"], timeout=300)
    assert loaded.returncode == 0 and not lock.exists()
