"""Decode steps through CUDA graphs (openinfer/worker/decode_graphs.py) yield the eager path's
tokens.

On a CUDA machine (``benchmarks/gpu_check.sh``) the worker captures the graphs itself and
the test checks that steps replayed them. On a CPU there are no graphs to capture: the test
attaches the same static buffers, padding and fixed attention plans with ``capture=False``
(the model runs eagerly on the buffers), with the Triton kernels in Triton's interpreter and
split-KV forced, so a plan made for ``max_model_len`` (splits past a sequence's end are empty)
is what every padded step attends with.
"""

from __future__ import annotations

import pytest
from attention_support import triton_test_device

DEVICE = triton_test_device()

from openinfer import LLM, SamplingParams  # noqa: E402
from openinfer.worker.decode_graphs import DecodeGraphs, capture_sizes  # noqa: E402

MAX_NUM_SEQS = 8


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = capture_sizes(10_000)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:]))


def _engine(path, enforce_eager: bool) -> LLM:
    return LLM(str(path), device=DEVICE, attention_backend="triton", enforce_eager=enforce_eager,
               max_num_seqs=MAX_NUM_SEQS, max_model_len=256, kv_cache_memory=4 * 2**20, seed=0)


def _attach_eager_buffers(llm: LLM) -> DecodeGraphs:
    """The CPU stand-in for the worker's capture: the same buffers, replayed eagerly."""
    from openinfer.attention.triton import TritonAttentionBackend

    worker = llm.engine.core.executor.worker
    runner = worker.runner
    graphs = DecodeGraphs(runner.model, runner.layer_caches, runner.layer_group, len(runner.groups),
                          TritonAttentionBackend(num_kv_splits=3), runner.block_size,
                          max_model_len=256, max_batch=MAX_NUM_SEQS, device=runner.device,
                          capture=False)
    runner.decode_graphs = graphs
    return graphs


MODELS = {
    "qwen3-window": ("Qwen3ForCausalLM", dict(num_layers=2, extra_config=dict(
        use_sliding_window=True, sliding_window=8, max_window_layers=1))),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(num_layers=2, num_kv_heads=2, extra_config=dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, decoder_sparse_step=1,
        norm_topk_prob=True))),
}


@pytest.mark.parametrize("model", ["qwen3", *MODELS])
def test_decode_graphs_match_eager(model, qwen3_checkpoint, make_checkpoint):
    """Five requests of different lengths that finish one by one: decode batches of 5, 4, 3,
    2 and 1 run at capture sizes 8, 4, 4, 2 and 1 (padded rows at 5 and 3). ``qwen3-window``:
    layer 0 full attention, layer 1 an 8-token sliding window (several KV groups, buffers
    for each; the window group's tables hold released blocks). ``qwen3-moe``: routed experts
    (on a GPU, Triton's grouped GEMMs captured with the rest; padded rows route too)."""
    checkpoint = qwen3_checkpoint
    if model in MODELS:
        arch, options = MODELS[model]
        checkpoint = make_checkpoint(arch, **options)
    prompts = [list(range(3 + 4 * i, 12 + 5 * i)) for i in range(5)]
    # Request i decodes 1 + i times (its first token comes from the prefill).
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True) for i in range(5)]
    eager = _engine(checkpoint, enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    assert eager.engine.core.executor.worker.runner.decode_graphs is None
    # The Triton backend's eager path itself gives the CPU engine's tokens (on a GPU: the
    # first check that the whole engine runs right there).
    on_cpu = LLM(str(checkpoint), device="cpu", max_num_seqs=MAX_NUM_SEQS, max_model_len=256,
                 kv_cache_memory=4 * 2**20, seed=0)
    assert [o.outputs[0].token_ids for o in on_cpu.generate(
        [{"prompt_token_ids": p} for p in prompts], params)] == expected
    assert (len(eager.engine.core.kv.groups) > 1) == (model == "qwen3-window")

    llm = _engine(checkpoint, enforce_eager=False)
    runner = llm.engine.core.executor.worker.runner
    if DEVICE == "cuda":
        graphs = runner.decode_graphs
        assert graphs is not None and graphs.capture, "the worker captured no graphs"
        assert llm.engine.core.compute_info["cuda_graphs"] == str(MAX_NUM_SEQS)
    else:
        assert runner.decode_graphs is None  # nothing to capture on a CPU
        graphs = _attach_eager_buffers(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    assert got == expected
    # Size 4 ran with 4 decodes, then with 3 and a padding row where a decode had been.
    assert {8, 4, 2, 1} <= set(graphs.replays), graphs.replays
