"""CPU GEMM plans (openinfer.kernels.gemm_plan): every path computes F.linear, plans route by rows,
timings are measured once per shape, the choice rules, the switch, and dtype 'auto' rules."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import openinfer.config
from openinfer import LLM, SamplingParams, cpu_allocator
from openinfer.config import _resolve_dtype
from openinfer.cpu_features import auto_cpu_dtype, cpu_capability, has_native_bf16
from openinfer.huge_pages import huge_pages_in_use
from openinfer.kernels import gemm_paths, gemm_plan
from openinfer.kernels.cpu_attention import bf16_dot, bf16_dot_paths, load_cpu_attention
from openinfer.kernels.gemm_paths import PATHS
from openinfer.kernels.gemm_plan import BUCKETS, EXTRA_COPY_MARGIN, choose_paths
from openinfer.layers.embedding import LMHead, VocabEmbedding
from openinfer.layers.linear import Linear, MergedLinear
from openinfer.models import gemm_plans
from openinfer.models.gemm_plans import describe_gemms, plan_gemms

ROWS = (1, 7, 33, 600)  # one row per bucket
ONLY = {"amx": torch.bfloat16, "mkl_packed": torch.float32, "widened": torch.bfloat16}
"""Paths with a kernel for one dtype only, on every CPU (the others run both): the other
dtype is not parametrized, so a skip means "not on this CPU"."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PATH_DTYPES = [pytest.param(path, dtype, id=f"{path}-{name}") for path in PATHS
               for name, dtype in DTYPES.items() if ONLY.get(path, dtype) == dtype]
SHAPES = [(13, 37), (96, 64), (200, 384), (256, 80), (128, 96)]  # (in, out): odd sizes, model-like


@pytest.fixture(autouse=True)
def fresh_timings(monkeypatch):
    """No timings from other tests; the small weights used here are timed all the same."""
    monkeypatch.setattr(gemm_plan, "MIN_TIMED_WEIGHT", 0)
    gemm_plan.clear_timing_cache()
    yield
    gemm_plan.clear_timing_cache()


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
            seed: int = 0) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    """A Linear with random weights (outputs of order 1), and copies of them."""
    g = torch.Generator().manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=g) / in_features**0.5)
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=g))
    return layer, layer.weight.detach().clone(), None if not bias else layer.bias.detach().clone()


def _plan_or_skip(module: nn.Module, mode: str) -> None:
    try:
        plan_gemms(module, mode)
    except ValueError as e:  # the path has no kernel for this dtype on this CPU
        pytest.skip(str(e))


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """fp32: tight against F.linear in float64; bf16: loose against F.linear in float32 on the
    same (bf16) numbers."""
    if x.dtype == torch.float32:
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    else:
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("path, dtype", PATH_DTYPES)
def test_each_path_equals_f_linear(path, dtype, bias):
    tested = 0
    for i, (k, n) in enumerate(SHAPES):
        layer, w, b = _linear(k, n, bias, dtype, seed=i)
        try:
            plan_gemms(layer, path)
        except ValueError as e:
            if "N a multiple of 16 and K of 32" in str(e):
                continue  # amx: a shape its tiles do not cover (auto plans leave amx out there)
            pytest.skip(str(e))  # no kernel for the path and dtype on this CPU (AMX, MKL)
        tested += 1
        assert layer.plan.paths == [path] * len(BUCKETS)
        for rows in ROWS:
            x = torch.randn(rows, k, dtype=dtype)
            _check(layer(x), x, w, b)
        x = torch.randn(2, 3, k, dtype=dtype)  # leading dims are flattened and restored
        assert layer(x).shape == (2, 3, n)
        _check(layer(x).reshape(6, n), x.reshape(6, k), w, b)
    assert tested


@pytest.mark.parametrize("path, dtype", [
    pytest.param(path, dtype, id=f"{path}-{name}") for path, only in ONLY.items()
    for name, dtype in DTYPES.items() if dtype != only])
def test_a_single_dtype_path_refuses_the_other(path, dtype):
    """On every CPU: forced onto a weight of the dtype it lacks, the path is refused."""
    layer, _, _ = _linear(96, 64, False, dtype)
    with pytest.raises(ValueError, match=f"{path} fails"):
        plan_gemms(layer, path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_auto_plan_equals_f_linear_in_every_bucket(dtype, monkeypatch):
    layer, w, b = _linear(96, 160, True, dtype)
    plan_gemms(layer, "auto")
    assert len(layer.plan.routes) == len(BUCKETS)
    for rows in ROWS:
        x = torch.randn(rows, 96, dtype=dtype)
        _check(layer(x), x, w, b)


def test_prefill_rows_are_padded_for_paths_that_build_per_row_count(monkeypatch):
    """oneDNN builds a primitive per row count: calls of over PAD_FROM_ROWS rows run on a
    multiple of PAD_ROWS (zero rows appended, their outputs dropped), other paths as given."""
    seen: list[int] = []
    for name in ("onednn_packed", "torch_t"):
        path = PATHS[name]
        monkeypatch.setitem(PATHS, name, dataclasses.replace(
            path, run=lambda x, w, b, run=path.run: (seen.append(x.shape[0]), run(x, w, b))[1]))
    for name, rows, expected in (("onednn_packed", 600, 608), ("onednn_packed", 608, 608),
                                 ("onednn_packed", 100, 100), ("torch_t", 200, 200)):
        layer, w, b = _linear(64, 96, True, torch.float32)
        _plan_or_skip(layer, name)
        seen.clear()
        x = torch.randn(rows, 64)
        out = layer(x)
        assert seen == [expected] and out.shape == (rows, 96) and out.is_contiguous()
        _check(out, x, w, b)


@pytest.mark.parametrize("path", ["auto", *PATHS])
def test_merged_linear_splits_after_planning(path):
    sizes = [24, 8, 8]
    layer = MergedLinear(40, sizes, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 40) / 40**0.5)
        layer.bias.copy_(torch.randn(40))
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    _plan_or_skip(layer, path)
    for rows in ROWS:
        x = torch.randn(rows, 40)
        q, k, v = layer.split(layer(x))
        ref = F.linear(x, w, b)
        assert (q.shape[-1], k.shape[-1], v.shape[-1]) == tuple(sizes)
        torch.testing.assert_close(torch.cat([q, k, v], -1), ref, atol=2e-5, rtol=1e-5)


def _filled(*layers: Linear) -> list[Linear]:
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.randn_like(layer.weight) / layer.weight.shape[1]**0.5)
    return list(layers)


def test_timings_are_measured_once_per_shape(monkeypatch):
    calls = []
    original = gemm_plan.time_paths

    def counting(paths, weight, bias, rows, weight_in, **kwargs):
        calls.append((tuple(weight.shape), bias is not None, rows))
        return original(paths, weight, bias, rows, weight_in, **kwargs)

    monkeypatch.setattr(gemm_plan, "time_paths", counting)
    model = nn.Sequential(*_filled(*(Linear(32, 48) for _ in range(5)), Linear(48, 32),
                                   Linear(48, 32, bias=True)))
    plan_gemms(model, "auto")
    distinct = 3  # (48, 32); (32, 48); (32, 48) with a bias
    timed_rows = {b.timed_rows for b in BUCKETS}  # the two prefill buckets share one timing
    assert len(calls) == distinct * len(timed_rows)
    assert sorted(set(calls)) == sorted(calls)  # each (shape, bias, rows) once
    # Identical layers make identical choices.
    assert len({tuple(m.plan.paths) for m in list(model)[:5]}) == 1
    plan_gemms(nn.Sequential(*_filled(Linear(32, 48))), "auto")  # another model: cached
    assert len(calls) == distinct * len(timed_rows)


def test_a_model_larger_than_the_cache_is_timed_cold(monkeypatch):
    """Few-row buckets flush the weight a path reads from the caches before each timed call;
    compute-bound buckets and models that fit the cache are timed hot."""
    if gemm_plan.cache_flusher() is None:
        pytest.skip("no cache flush here (no CPU extension, or no flush instruction)")
    events: list[tuple] = []  # ("call", rows, address) or ("flush", address, nbytes)
    for name in ("torch", "onednn"):
        path = PATHS[name]

        def run(x, w, b, path=path):
            events.append(("call", x.shape[0], w.data_ptr()))
            return path.run(x, w, b)

        monkeypatch.setitem(PATHS, name, gemm_paths.GemmPath(name, path.weight_format, run, path.rows))
    monkeypatch.setattr(gemm_plan, "PATHS", {n: PATHS[n] for n in ("torch", "onednn")})
    flush = gemm_plan.cache_flusher()

    def recording(t):
        events.append(("flush", t.data_ptr(), t.numel() * t.element_size()))
        flush(t)

    monkeypatch.setattr(gemm_plans, "cache_flusher", lambda: recording)
    monkeypatch.setattr(gemm_plans, "last_level_cache_bytes", lambda: 4096)
    layer = _filled(Linear(64, 64))[0]  # 16 KiB: outgrows a 4 KiB "cache"
    address = layer.weight.data_ptr()
    plan_gemms(nn.Sequential(layer), "auto")
    for bucket in BUCKETS:
        at = [i for i, e in enumerate(events) if e[:2] == ("call", bucket.timed_rows)]
        timed = at[1:]  # the first call per path checks it (the reference is F.linear itself)
        assert timed
        for i in timed:
            flushed = events[i - 1] == ("flush", address, 64 * 64 * 4)
            assert flushed == (bucket.timed_rows <= gemm_plan.COLD_MAX_ROWS), (bucket, events[i - 1])
    monkeypatch.setattr(gemm_plans, "last_level_cache_bytes", lambda: 1 << 30)  # the model fits
    gemm_plan.clear_timing_cache()
    events.clear()
    plan_gemms(nn.Sequential(_filled(Linear(64, 64))[0]), "auto")
    assert events and not any(e[0] == "flush" for e in events)


def test_the_cache_flush_evicts_what_it_is_given(kernels):
    """evict_from_cache takes any address and length (unaligned, empty, oneDNN's opaque packed
    weight through cache_flusher) and leaves the bytes as they were."""
    flush = gemm_plan.cache_flusher()
    if flush is None:
        pytest.skip("no cache flush instruction on this CPU")
    x = torch.randn(1000, 37)
    before = x.clone()
    assert kernels.evict_from_cache(x.data_ptr() + 3, 1001)
    assert kernels.evict_from_cache(x.data_ptr(), 0)
    flush(x)
    flush(x[7:, 5:])
    torch.testing.assert_close(x, before, rtol=0, atol=0)
    try:
        packed = gemm_paths.pack_weight(torch.randn(64, 64))
    except RuntimeError:
        return  # oneDNN cannot pack here
    flush(packed)


def test_lm_head_times_its_first_buckets_and_keeps_a_tied_weight(monkeypatch):
    calls = []
    original = gemm_plan.time_paths

    def counting(paths, weight, bias, rows, weight_in, **kwargs):
        calls.append(rows)
        return original(paths, weight, bias, rows, weight_in, **kwargs)

    monkeypatch.setattr(gemm_plan, "time_paths", counting)
    model = nn.Module()
    model.embed = VocabEmbedding(300, 32)
    model.head = LMHead(300, 32, tied_to=model.embed)
    with torch.no_grad():
        model.embed.weight.copy_(torch.randn(300, 32))
    w = model.embed.weight.detach().clone()
    plan_gemms(model, "auto")
    assert sorted(calls) == sorted(b.timed_rows for b in BUCKETS[:LMHead.timed_buckets])
    paths = model.head.plan.paths
    last = gemm_plan.PATHS[paths[LMHead.timed_buckets - 1]]
    for bucket, path in zip(BUCKETS[LMHead.timed_buckets:], paths[LMHead.timed_buckets:]):
        assert path == (last.name if last.timed_in(bucket) else "torch")
    assert model.embed.weight.device.type == "cpu"  # shared: never freed
    x = torch.randn(5, 32)
    torch.testing.assert_close(model.head(x), F.linear(x, w), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(model.embed(torch.tensor([3, 299])), w[[3, 299]])


def test_a_packed_only_plan_frees_the_plain_weight():
    layer, w, _ = _linear(64, 96, False, torch.float32)
    _plan_or_skip(layer, "onednn_packed")
    assert layer.weight.device.type == "meta" and layer.weight.shape == (96, 64)
    assert sum(p.numel() for p in layer.parameters()) == 96 * 64  # still counted
    assert layer.plan.extra_bytes == 0
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, w), atol=2e-5, rtol=1e-5)


def test_default_switch_and_bad_values(monkeypatch):
    layer, w, _ = _linear(16, 8, False, torch.float32)
    monkeypatch.setenv(gemm_plan.ENV_VAR, "default")
    plan_gemms(layer)
    assert layer.plan is None and describe_gemms(layer).label == "default"
    x = torch.randn(4, 16)
    torch.testing.assert_close(layer(x), F.linear(x, w))
    monkeypatch.setenv(gemm_plan.ENV_VAR, "fastest")
    with pytest.raises(ValueError, match="OPENINFER_CPU_GEMM must be one of"):
        plan_gemms(layer)
    monkeypatch.setenv(gemm_plan.ENV_VAR, "torch_t")
    plan_gemms(layer)
    assert layer.plan.paths == ["torch_t"] * len(BUCKETS)
    assert describe_gemms(layer).label == "torch_t"


def test_small_weights_run_f_linear_untimed(monkeypatch):
    monkeypatch.setattr(gemm_plan, "MIN_TIMED_WEIGHT", 16 * 8 + 1)
    monkeypatch.setattr(gemm_plan, "time_paths", None)  # must not be called
    layer, _, _ = _linear(16, 8, False, torch.float32)
    plan_gemms(layer, "auto")
    assert layer.plan.paths == ["torch"] * len(BUCKETS)


def test_bf16_widened_in_registers_is_fp32_small_gemm_rounded_once():
    """small_gemm on a bf16 weight widens it in registers and accumulates as on float32: its
    result is the float32 kernel's on the widened numbers, rounded to bf16 once, bit for bit
    (both lane widths' tails: K = 1000 is no multiple of 8 or 16)."""
    kernels = load_cpu_attention()
    if kernels is None:
        pytest.skip("no CPU extension")
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 5, 16):
        x = torch.randn(rows, 1000, generator=g).bfloat16()
        w = (torch.randn(77, 1000, generator=g) / 30).bfloat16()
        b = torch.randn(77, generator=g).bfloat16()
        out, out32 = torch.empty(rows, 77, dtype=torch.bfloat16), torch.empty(rows, 77)
        kernels.small_gemm(out, x, w, b)
        kernels.small_gemm(out32, x.float(), w.float(), b.float())
        assert torch.equal(out, out32.bfloat16())
        _check(out, x, w, b)


def test_bf16_is_planned_on_every_cpu():
    """Where the CPU has no bf16 GEMM instructions, ATen converts bf16 element by element;
    the widening paths are timed there like the rest (no CPU is left without plans)."""
    layer, w, _ = _linear(256, 512, False, torch.bfloat16)
    plan_gemms(layer, "auto")
    assert layer.plan is not None and len(layer.plan.routes) == len(BUCKETS)
    for rows in ROWS:
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        _check(layer(x), x, w, None)


def test_models_off_the_cpu_get_no_plans():
    with torch.device("meta"):
        layer = Linear(16, 8)
    plan_gemms(layer, "auto")
    assert layer.plan is None


def test_a_path_that_fails_is_left_out_or_refused(monkeypatch):
    def no_kernel(weight):
        raise RuntimeError("no oneDNN kernel for this dtype here")

    monkeypatch.setattr(gemm_paths, "pack_weight", no_kernel)
    layer, w, _ = _linear(32, 16, False, torch.float32)
    plan_gemms(layer, "auto")
    assert "onednn_packed" not in layer.plan.paths
    with pytest.raises(ValueError, match="onednn_packed fails: no oneDNN kernel"):
        plan_gemms(_linear(32, 16, False, torch.float32)[0], "onednn_packed")


def test_a_path_that_disagrees_with_f_linear_is_left_out(monkeypatch):
    wrong = gemm_paths.GemmPath("torch_t", gemm_paths.PLAIN, lambda x, w, b: F.linear(x, w, b) * 1.01,
                          rows=(2, 256))
    monkeypatch.setitem(gemm_plan.PATHS, "torch_t", wrong)
    layer, _, _ = _linear(32, 16, False, torch.float32)
    plan_gemms(layer, "auto")
    assert "torch_t" not in layer.plan.paths
    with pytest.raises(ValueError, match="differs from F.linear"):
        plan_gemms(_linear(32, 16, False, torch.float32)[0], "torch_t")


# ----------------------------------------------------------------------------- in the engine


def _generate(model: str, prompts: list[list[int]], dtype: str = "auto") -> tuple[LLM, list]:
    llm = LLM(model, progress=False, kv_cache_memory=1 << 24, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    return llm, llm.generate(prompts, params)


@pytest.mark.parametrize("path", [p for p in PATHS if ONLY.get(p, torch.float32) == torch.float32])
def test_every_path_gives_the_engine_the_same_logprobs(path, qwen3_checkpoint, monkeypatch):
    """Through load_model's plans and the LM head: prefills of 1..150 rows (every bucket) and
    batched decodes give F.linear's logprobs (float32; amx, bfloat16 only, has its own test:
    test_the_amx_path_gives_the_engine_the_same_logprobs)."""
    prompts = [[7], [5, 9, 200, 31], list(range(40, 90)), [(7 * i) % 500 for i in range(150)]]
    monkeypatch.setenv(gemm_plan.ENV_VAR, "default")
    _, expected = _generate(str(qwen3_checkpoint), prompts)
    monkeypatch.setenv(gemm_plan.ENV_VAR, path)
    llm, outs = _generate(str(qwen3_checkpoint), prompts)
    assert llm.engine.core.compute_info["gemm"] == path
    assert llm.engine.core.compute_info["dtype"] == "float32"
    _assert_same_logprobs(outs, expected, tol=1e-4)


def test_the_amx_path_gives_the_engine_the_same_logprobs(qwen3_checkpoint, monkeypatch):
    """bfloat16 through AMX tiles: every bucket's rows, the LM head, and the tokens, as F.linear
    gives them (to bf16's rounding: both accumulate in fp32, in different orders)."""
    if not _amx_here():
        pytest.skip("no AMX-BF16 here")
    prompts = [[7], [5, 9, 200, 31], list(range(40, 90)), [(7 * i) % 500 for i in range(150)]]
    monkeypatch.setenv(gemm_plan.ENV_VAR, "default")
    _, expected = _generate(str(qwen3_checkpoint), prompts, dtype="bfloat16")
    monkeypatch.setenv(gemm_plan.ENV_VAR, "amx")
    llm, outs = _generate(str(qwen3_checkpoint), prompts, dtype="bfloat16")
    assert llm.engine.core.compute_info["gemm"] == "amx"
    _assert_same_logprobs(outs, expected, tol=5e-2)


def _amx_here() -> bool:
    kernels = load_cpu_attention()
    return kernels is not None and kernels.amx_gemm_available()


def _assert_same_logprobs(outs: list, expected: list, tol: float) -> None:
    for out, ref in zip(outs, expected):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        want = [lp[t].logprob for lp, t in zip(ref.prompt_logprobs[1:], ref.prompt_token_ids[1:])]
        got += [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        want += [lp[t].logprob for lp, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=tol, rtol=tol)


def test_the_engine_reports_how_it_computes(qwen3_checkpoint, monkeypatch):
    monkeypatch.setenv(gemm_plan.ENV_VAR, "auto")
    llm = LLM(str(qwen3_checkpoint), progress=False, kv_cache_memory=1 << 24)
    info = llm.engine.core.compute_info
    assert set(info) == {"dtype", "gemm", "cpu_capability", "attention", "attention_bf16_dot",
                         "huge_pages", "cpu_allocator_cache", "cuda_graphs", "experts"}
    assert info["cpu_allocator_cache"] == str(cpu_allocator.cache_limit())
    assert info["cuda_graphs"] == "" and info["experts"] == ""  # none on a CPU; a dense model
    assert info["dtype"] == "float32" and info["cpu_capability"] == cpu_capability()
    assert info["attention_bf16_dot"] == ""  # a float32 model has no bf16 products to choose
    assert info["huge_pages"] == ("on" if huge_pages_in_use() else "off")
    assert set(info["gemm"].split("+")) <= set(PATHS)  # timed: MIN_TIMED_WEIGHT is 0 here


def test_a_bf16_engine_reports_the_attention_products_it_chose(qwen3_checkpoint, caplog):
    if load_cpu_attention() is None:
        pytest.skip("no CPU kernel extension")
    with caplog.at_level(logging.INFO, logger="openinfer.worker.worker"):
        llm = LLM(str(qwen3_checkpoint), dtype="bfloat16", progress=False, kv_cache_memory=1 << 24)
    chosen = llm.engine.core.compute_info["attention_bf16_dot"]
    assert chosen in bf16_dot_paths() and chosen == bf16_dot()
    assert f"bf16 attention products: {chosen}" in caplog.text


# ----------------------------------------------------------------------------- choice rules


def _times(*buckets: dict[str, float]) -> list[dict[str, float]]:
    return list(buckets)


def test_torch_unless_another_path_is_clearly_faster():
    even = {"torch": 1.0, "onednn": 0.97, "onednn_packed": 0.98}
    assert choose_paths(_times(even, even)) == ["torch", "torch"]
    assert choose_paths(_times(even, {"torch": 1.0, "onednn": 0.5, "onednn_packed": 0.9})) == [
        "torch", "onednn"]


def test_packed_weights_when_they_are_faster_overall():
    times = _times({"torch": 1.0, "onednn": 1.1, "onednn_packed": 1.1},
                   {"torch": 2.0, "onednn": 1.9, "onednn_packed": 1.0},
                   {"torch": 3.0, "onednn": 2.9, "onednn_packed": 1.5})
    assert choose_paths(times) == ["onednn_packed"] * 3


def test_one_copy_per_layer_plain_or_packed():
    # Plain torch 2x faster at M=1, packed 2x faster for batches: one format must serve both.
    times = _times({"torch": 1.0, "onednn": 2.0, "onednn_packed": 2.0},
                   {"torch": 2.0, "onednn": 2.0, "onednn_packed": 1.0})
    assert choose_paths(times) == ["torch", "torch"]
    # With a plain oneDNN path nearly as fast as the packed one, plain serves both well.
    times[1]["onednn"] = 1.1
    assert choose_paths(times) == ["torch", "onednn"]
    # Plain oneDNN slow again, packed nearly as fast as torch at M=1: packed for all.
    times[1]["onednn"], times[0]["onednn_packed"] = 2.0, 1.05
    assert choose_paths(times) == ["onednn_packed", "onednn_packed"]


def test_a_shared_weight_gets_a_packed_copy_only_when_it_pays():
    kept = frozenset({gemm_paths.PLAIN})  # a tied embedding holds the plain weight anyway
    times = _times({"torch": 1.0, "onednn_packed": 0.9}, {"torch": 1.0, "onednn_packed": 0.8})
    assert choose_paths(times) == ["onednn_packed"] * 2  # not shared: packed replaces plain
    assert choose_paths(times, kept=kept) == ["torch", "torch"]  # no budget for a copy
    assert choose_paths(times, kept=kept, may_copy=True) == ["onednn_packed"] * 2
    times = _times({"torch": 1.0, "onednn_packed": 0.97}, {"torch": 1.0, "onednn_packed": 0.97})
    assert choose_paths(times, kept=kept, may_copy=True) == ["torch", "torch"]  # not worth it
    times[1]["onednn_packed"] = 0.99 / EXTRA_COPY_MARGIN
    times[0]["onednn_packed"] = 2.0  # the copy serves only the buckets where it is faster
    assert choose_paths(times, kept=kept, may_copy=True) == ["torch", "onednn_packed"]


def test_a_second_format_when_the_budget_allows():
    # amx-like: packed 2x faster for few rows, 1.3x slower for many; plain the reverse.
    times = _times({"torch": 1.0, "onednn_packed": 0.5}, {"torch": 1.0, "onednn_packed": 0.5},
                   {"torch": 1.0, "onednn_packed": 1.3})
    assert choose_paths(times) == ["onednn_packed", "onednn_packed", "onednn_packed"]
    assert choose_paths(times, may_copy=True) == ["onednn_packed", "onednn_packed", "torch"]
    times[2]["onednn_packed"] = 1.02  # under EXTRA_COPY_MARGIN: not worth a copy
    assert choose_paths(times, may_copy=True) == ["onednn_packed"] * 3


def test_second_copies_stop_at_the_memory_budget(monkeypatch):
    """plan_gemms gives second copies while OPENINFER_CPU_GEMM_EXTRA_MEMORY lasts, each layer
    then routes prefill-sized calls to its second copy, and every route computes F.linear."""
    def fake_times(paths, weight, bias, rows, weight_in, **kwargs):
        fast_packed = rows <= 128  # packed 2x faster for decode-sized calls, 1.5x slower above
        return {"torch": 1.0, "onednn_packed": 0.5 if fast_packed else 1.5}

    monkeypatch.setattr(gemm_plan, "time_paths", fake_times)
    model = nn.Sequential(*(_linear(64, 96, False, torch.float32, seed=i)[0] for i in range(3)))
    weights = [m.weight.detach().clone() for m in model]
    weight_bytes = 64 * 96 * 4
    monkeypatch.setenv(gemm_plan.EXTRA_MEMORY_ENV, str(2 * weight_bytes))
    try:
        plan_gemms(model, "auto")
    except RuntimeError as e:  # oneDNN cannot pack here
        pytest.skip(str(e))
    assert [m.plan.paths for m in model] == [["onednn_packed"] * 3 + ["torch"] * 2] * 2 + [
        ["onednn_packed"] * 5]
    assert [m.plan.extra_bytes for m in model] == [weight_bytes, weight_bytes, 0]
    assert describe_gemms(model).extra_bytes == 2 * weight_bytes
    for layer, w in zip(model, weights):
        for rows in ROWS:
            x = torch.randn(rows, 64)
            _check(layer(x), x, w, None)
    monkeypatch.setenv(gemm_plan.EXTRA_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match=gemm_plan.EXTRA_MEMORY_ENV):
        gemm_plan.extra_copy_budget()
    monkeypatch.setenv(gemm_plan.EXTRA_MEMORY_ENV, "1MiB")
    assert gemm_plan.extra_copy_budget() == 2**20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paths_that_build_per_row_count_need_a_margin_up_to_1024_rows(monkeypatch, dtype):
    """In 129..1024 rows oneDNN (which builds a primitive per row count) must be BUILD_MARGIN
    faster than a path that builds nothing, for 16-bit weights; above 1024 rows, and for
    float32 weights everywhere, the timed fastest runs."""
    def fake_times(paths, weight, bias, rows, weight_in, **kwargs):
        # oneDNN's packed linear builds per row count; the widened path (MKL) never does, nor
        # F.linear in float32 (MKL; in bf16 it is oneDNN's).
        return {"torch": 1.0, "widened": 1.0, "onednn_packed": 0.5 if rows <= 128 else 0.85}

    monkeypatch.setattr(gemm_plan, "time_paths", fake_times)
    monkeypatch.setenv(gemm_plan.EXTRA_MEMORY_ENV, "1GiB")
    layer, w, _ = _linear(64, 96, False, dtype, seed=0)
    try:
        plan_gemms(nn.Sequential(layer), "auto")
    except RuntimeError as e:  # oneDNN cannot pack this dtype here
        pytest.skip(str(e))
    assert 0.85 * gemm_plan.BUILD_MARGIN > 1.0 * gemm_plan.EXTRA_COPY_MARGIN
    assert [str(b) for b in BUCKETS[3:]] == ["M=129-1024", "M>1024"]
    middle = "widened" if dtype in gemm_plan.BUILD_MARGIN_DTYPES else "onednn_packed"
    assert layer.plan.paths == ["onednn_packed"] * 3 + [middle, "onednn_packed"]
    for rows in (200, 1024, 1025, 1100):
        x = torch.randn(rows, 64, dtype=dtype)
        _check(layer(x), x, w, None)


def test_only_paths_that_ran_are_chosen():
    assert choose_paths(_times({"torch": 1.0}, {"torch": 1.0, "torch_t": 0.5})) == [
        "torch", "torch_t"]


# ----------------------------------------------------------------------------- dtype auto


@pytest.mark.parametrize("checkpoint,flags,expected", [
    ("bfloat16", {"avx2", "fma"}, torch.float32),            # Zen 3: bf16 slower than fp32
    ("bfloat16", {"avx512f", "avx512_bf16"}, torch.bfloat16),  # Zen 4/5, Cooper Lake
    ("bfloat16", {"amx_bf16", "amx_tile"}, torch.bfloat16),    # Sapphire Rapids
    ("float32", {"avx512_bf16"}, torch.float32),
    ("float16", {"avx512_bf16", "amx_bf16"}, torch.float32),
    (None, {"avx512_bf16"}, torch.float32),
])
def test_auto_cpu_dtype(checkpoint, flags, expected):
    dtype, reason = auto_cpu_dtype(checkpoint, flags)
    assert dtype == expected and reason
    assert has_native_bf16(flags) == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_resolve_dtype_reads_the_cpu_flags(monkeypatch, caplog):
    bf16_config = {"torch_dtype": "bfloat16"}
    monkeypatch.setattr(openinfer.config, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    with caplog.at_level("INFO", logger="openinfer.config"):
        assert _resolve_dtype("auto", bf16_config, "cpu") == torch.bfloat16
    assert "dtype auto: bfloat16 on this CPU (bfloat16 checkpoint and the CPU has avx512_bf16)" \
        in caplog.text
    assert _resolve_dtype("auto", {"dtype": "bfloat16"}, "cpu") == torch.bfloat16
    monkeypatch.setattr(openinfer.config, "cpu_flags", lambda: frozenset({"avx2"}))
    assert _resolve_dtype("auto", bf16_config, "cpu") == torch.float32
    assert _resolve_dtype("bfloat16", {}, "cpu") == torch.bfloat16  # asked for: given
    assert _resolve_dtype("auto", bf16_config, "cuda") == torch.bfloat16  # CUDA: the checkpoint's
