"""--batch-invariant: a request's logits, and so its logprobs and its greedy and seeded tokens,
are bitwise the same alone and in any batch (decodes and prefills mixed, chunked or not, prefix
hits, preemption, any batch size), on both attention backends; without the flag they are not.
Plus the parts: each attention backend's invariant mode against the oracle, the activation
under any thread split, the flag's plumbing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_support import ATTENTION_BACKENDS, attention_backend
from conftest import build_checkpoint

from openinfer import LLM, SamplingParams
from openinfer.attention import build_attention_metadata
from openinfer.cli import build_parser, engine_kwargs
from openinfer.engine_args import create_engine_config
from openinfer.executor.checks import check_tensor_parallel
from openinfer.kernels import gemm_plan, invariant_gemm
from openinfer.kernels.cpu_attention import paged_attention_reference
from openinfer.kernels.gemm_paths import PLAIN, GemmPath
from openinfer.kernels.invariant_gemm import (
    checked_sizes,
    invariant_silu_and_mul,
    plan_invariant_gemm,
)
from openinfer.layers.linear import Linear

GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=5,
                        ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=6, logprobs=5,
                        ignore_eos=True)
KV_BYTES = 8 * 2**20
SMALL_KV_BLOCKS = 12
"""For max_model_len 160: the larger batches do not fit, so requests are preempted and
recomputed. A block is 16 tokens x 2 layers x K/V x 2 heads x 32 values."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    # GQA 4:1, head_dim 32: every GEMM has several shapes, attention several query rows per head.
    return build_checkpoint(tmp_path_factory.mktemp("bi"), "Qwen3ForCausalLM", tokenizer,
                            hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
                            head_dim=32, intermediate_size=384)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


TARGET = _ids(70, 0)  # five 16-token blocks (the last partial): chunked, multi-block


def _others(count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """``count`` other requests: long and short prompts (one sharing the target's first 48
    tokens), greedy and sampled, finishing at different steps, some scoring their prompt."""
    lengths = [100, 3, 41, TARGET[:48] + _ids(9, 99), 1, 66, 17, 130]
    prompts = [p if isinstance(p, list) else _ids(p, 10 + i) for i, p in enumerate(lengths)]
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, max_tokens=1 + (3 * i) % 7,
                             ignore_eos=True, prompt_logprobs=2 if i % 3 == 1 else None)
              for i in range(len(prompts))]
    return prompts[:count], params[:count]


def _signature(out) -> tuple:
    """Everything the logits decide, as exact floats."""
    c = out.outputs[0]

    def positions(entries):
        return [None if e is None else sorted((t, lp.logprob, lp.rank) for t, lp in e.items())
                for e in entries or []]

    return c.token_ids, positions(c.logprobs), positions(out.prompt_logprobs)


def _runs(llm: LLM) -> list[tuple[str, tuple, tuple]]:
    """(composition, greedy target's signature, seeded target's signature): each target alone,
    then both inside batches of 1, 3 and 8 other requests at different places."""
    alone = [_signature(llm.generate([TARGET], p)[0]) for p in (GREEDY, SEEDED)]
    runs = [("alone", *alone)]
    for count, at in ((1, 1), (3, 0), (8, 5)):
        prompts, params = _others(count)
        prompts[at:at] = [TARGET, TARGET]
        params[at:at] = [GREEDY, SEEDED]
        outs = llm.generate(prompts, params)
        runs.append((f"{count} others", _signature(outs[at]), _signature(outs[at + 1])))
    return runs


CASES = [(backend, chunked, "float32") for backend in ATTENTION_BACKENDS
         for chunked in (True, False)] + [("cpu", True, "bfloat16")]


@pytest.mark.parametrize(("backend", "chunked", "dtype"), CASES,
                         ids=[f"{b}-{'chunked' if c else 'unchunked'}-{d}" for b, c, d in CASES])
def test_logits_do_not_depend_on_the_batch(checkpoint, backend, chunked, dtype):
    attention_backend(backend)  # skips where the CPU kernel cannot be built
    # Chunked: a 40-token budget cuts the target's prompt at places that depend on the batch,
    # and a small KV pool preempts requests (the greedy target among them) and recomputes them.
    llm = LLM(str(checkpoint), attention_backend=backend, batch_invariant=True,
              kv_cache_memory=SMALL_KV_BLOCKS * 16 * 256 * (4 if dtype == "float32" else 2)
              if chunked else KV_BYTES, max_model_len=160,
              enable_chunked_prefill=chunked, max_num_batched_tokens=40 if chunked else 512,
              dtype=dtype, progress=False)
    assert llm.engine.core.compute_info["gemm"].startswith("invariant:")
    runs = _runs(llm)
    assert (llm.engine.core.scheduler.num_preemptions > 0) == chunked
    (_, greedy, seeded), batched = runs[0], runs[1:]
    assert len(greedy[0]) == 6 and len(greedy[2]) == len(TARGET)
    for name, g, s in batched:
        for what, got, want in (("greedy", g, greedy), ("seeded", s, seeded)):
            for part, a, b in zip(("tokens", "logprobs", "prompt logprobs"), got, want):
                assert a == b, f"{what} target, {part}, with {name}"


def test_two_tensor_parallel_ranks_stay_batch_invariant(checkpoint):
    """Under TP=2 each rank's GEMMs are invariant and the all-reduce adds two partial sums
    per element (the same whichever comes first), the logits' all-gather only concatenates:
    a request's logits are still bitwise the same in any batch. (More ranks are refused.)"""
    llm = LLM(str(checkpoint), batch_invariant=True, tensor_parallel_size=2,
              kv_cache_memory=KV_BYTES, max_model_len=160, max_num_batched_tokens=40,
              progress=False)
    try:
        assert llm.engine.core.compute_info["gemm"].startswith("invariant:")
        alone = [_signature(llm.generate([TARGET], p)[0]) for p in (GREEDY, SEEDED)]
        prompts, params = _others(8)  # (the chunked prefill cuts the target's prompt apart)
        outs = llm.generate(prompts[:5] + [TARGET, TARGET] + prompts[5:],
                            params[:5] + [GREEDY, SEEDED] + params[5:])
    finally:
        llm.engine.core.shutdown()
    assert [_signature(outs[5]), _signature(outs[6])] == alone
    four = create_engine_config(str(checkpoint), batch_invariant=True, tensor_parallel_size=4,
                               nnodes=2)  # (2 ranks on this machine: they fit its cores)
    with pytest.raises(ValueError, match="--batch-invariant on more than 2 ranks"):
        check_tensor_parallel(four)


def test_without_the_flag_logits_depend_on_the_batch(checkpoint):
    # The same runs, default mode: BLAS kernels chosen by row count (F.linear gives a row one
    # value for 1 row, another for 2-3, another for 4+), attention split by batch cost.
    llm = LLM(str(checkpoint), kv_cache_memory=KV_BYTES, max_num_batched_tokens=40,
              progress=False)
    runs = _runs(llm)
    alone = runs[0][1:]
    assert any(run[1:] != alone for run in runs[1:])


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_invariant_attention_matches_the_oracle(backend):
    """A step of decodes, a fresh prompt, a chunked continuation and a 1-token chunk, over
    shuffled blocks; whatever a sequence must not read is NaN."""
    impl = attention_backend(backend)
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, bs = 8, 2, 32, 16
    query_lens, seq_lens = [1, 1, 1, 37, 20, 1], [1, 70, 16, 37, 100, 129]
    need = [-(-n // bs) for n in seq_lens]
    blocks = torch.randperm(sum(need) + 3, generator=g).tolist()
    cache = torch.randn(2, len(blocks), bs, kv_heads, head_dim, generator=g)
    tables, used = [], 0
    for n, length in zip(need, seq_lens):
        tables.append(blocks[used:used + n])
        used += n
        if length % bs:
            cache[:, tables[-1][-1], length % bs:] = float("nan")  # past the sequence
    cache[:, blocks[used:]] = float("nan")  # nobody's blocks
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g)
    # The step's own K/V are already in the cache: attend without writing (empty k/v).
    meta = build_attention_metadata(impl, query_lens, seq_lens, tables, bs)
    empty = torch.empty(0, kv_heads, head_dim)
    meta.slot_mapping = torch.empty(0, dtype=torch.long)
    out = impl.forward_batch_invariant(q, empty, empty, cache, meta, head_dim**-0.5)
    want = torch.empty_like(q)
    paged_attention_reference(want, q, cache[0], cache[1], meta.block_tables,
                              meta.query_start_loc, meta.seq_lens, head_dim**-0.5,
                              meta.max_query_len)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_cpu_kernel_invariant_mode_plans_no_shared_or_split_items():
    attention_backend("cpu")
    from openinfer.kernels.cpu_attention import load_cpu_attention

    ext = load_cpu_attention()
    # 8 decodes sharing a 4-block prefix (cascade), then one long decode alone (split-KV).
    shared = dict(block_tables=torch.tensor([[0, 1, 2, 3, 4 + b] for b in range(8)],
                                            dtype=torch.int32),
                  query_start_loc=torch.arange(9, dtype=torch.int32),
                  seq_lens=torch.full((8,), 70, dtype=torch.int32))
    single = dict(block_tables=torch.arange(64, dtype=torch.int32)[None],
                  query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                  seq_lens=torch.tensor([1024], dtype=torch.int32))
    for batch in (shared, single):
        args = (*batch.values(), 2, 4, 16, 4)  # kv heads, group, block size, threads
        assert ext.plan_stats(*args)[1:] != (0, 0)  # the normal plan shares or splits
        assert ext.plan_stats(*args, invariant=True)[1:] == (0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_rows_do_not_depend_on_the_call(dtype):
    g = torch.Generator().manual_seed(0)
    layer = Linear(96, 200, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=g) / 96**0.5)
        layer.bias.copy_(torch.randn(200, generator=g))
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    plan = plan_invariant_gemm(layer.weight.data, None if layer.bias is None else layer.bias.data)
    x = torch.randn(300, 96, generator=g).to(dtype)
    alone = torch.cat([plan(x[i:i + 1]) for i in range(len(x))])
    torch.testing.assert_close(alone.float(), F.linear(x.float(), weight.float(), bias.float()),
                               atol=0.05 if dtype == torch.bfloat16 else 1e-4, rtol=0.02)
    for start, rows in ((0, 300), (3, 7), (5, 128), (17, 200), (290, 1), (0, 2)):
        assert torch.equal(plan(x[start:start + rows]), alone[start:start + rows]), (start, rows)


def test_gemm_sizes_whose_rows_differ_are_never_run():
    # A path that computes small calls one way and calls of 16+ rows another: only 16+ pass,
    # and a plan on it pads 1..15 rows to 16.
    def run(x, w, b):
        if len(x) >= 16:
            return F.linear(x.double(), w.double()).float()
        return F.linear(x, w)

    path = GemmPath("split", PLAIN, run)
    weight = torch.randn(64, 48) / 48**0.5
    invariant_gemm.clear_check_cache()
    assert checked_sizes(path, weight, None, lambda fmt: weight) == (16, 32, 64, 128)
    invariant_gemm.clear_check_cache()


def test_no_path_passing_runs_row_by_row(monkeypatch):
    def by_place(x, w, b):  # right within tolerance, but a row's bits depend on its place
        return F.linear(x, w, b) + torch.arange(len(x))[:, None] * 1e-7

    monkeypatch.setitem(gemm_plan.PATHS, "by_place", GemmPath("by_place", PLAIN, by_place))
    monkeypatch.setattr(invariant_gemm, "PATH_PREFERENCE", ("by_place",))
    invariant_gemm.clear_check_cache()
    layer = Linear(48, 64)
    torch.nn.init.normal_(layer.weight, std=48**-0.5)
    plan = plan_invariant_gemm(layer.weight.data, None if layer.bias is None else layer.bias.data)
    invariant_gemm.clear_check_cache()
    assert plan.invariant_sizes == (1,) and plan.paths[0] == "torch"
    x = torch.randn(37, 48)
    assert torch.equal(plan(x), torch.cat([F.linear(x[i:i + 1], layer.weight) for i in range(37)]))


@pytest.mark.parametrize("threads", [3, 5, 12])
def test_activation_rows_do_not_depend_on_thread_splits(threads):
    # torch splits a large elementwise op across threads at any element; the elements before
    # the next vector boundary take scalar code, whose silu rounds differently.
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for width in (3072, 1536, 100):
            gate_up = torch.randn(1001, 2 * width, generator=torch.Generator().manual_seed(1)) * 3
            gate, up = gate_up.split(width, dim=-1)
            alone = torch.cat([F.silu(gate[i:i + 1]) * up[i:i + 1] for i in range(len(gate))])
            assert torch.equal(invariant_silu_and_mul(gate, up), alone), width
    finally:
        torch.set_num_threads(previous)


def test_the_flag_reaches_the_config(checkpoint):
    args = build_parser().parse_args(["generate", "--prompt", "x", "--batch-invariant"])
    assert engine_kwargs(args)["batch_invariant"] is True
    assert create_engine_config(str(checkpoint), device="cpu",
                               batch_invariant=True).model.batch_invariant
    assert not create_engine_config(str(checkpoint), device="cpu").model.batch_invariant
    with pytest.raises(ValueError, match="batch_invariant: supported on CPU only"):
        create_engine_config(str(checkpoint), device="cuda", batch_invariant=True)
