"""``--kv-cache-dtype fp8`` through the engine: a float8 KV cache (e4m3 or e5m2) holds 4x a
float32 cache's tokens (2x bf16's) in the same memory, the CPU kernels give the torch
reference backend's tokens on the same float8 cache (GQA and MLA models), and every fast path
(prefix hit, host and file tiers, a disaggregated run, speculative decoding, batch-invariant
mode) gives a cold run's tokens. The checkpoint's per-tensor
k/v scales reach the kernels; a model whose caches cannot be float8 is refused by name.
(The server's flag: tests/e2e/test_serve_options.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import DEEPSEEK_V4, build_checkpoint, randomize_v4, run_disaggregated
from safetensors.torch import load_file, save_file
from test_mla_engine import V3

from openinfer import LLM, SamplingParams
from openinfer.layers.attention import Attention
from openinfer.layers.mla import MLAAttention

MiB = 1024**2
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 900 + 5 for j in range(n)] for i, n in enumerate((70, 5, 33, 18))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer) -> dict:
    root = tmp_path_factory.mktemp("fp8kv")
    gpt_oss = build_checkpoint(root / "gptoss", "GptOssForCausalLM", tokenizer, extra_config=dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"]))
    tensors = load_file(gpt_oss / "model.safetensors")
    for name in [n for n in tensors if n.endswith("sinks")]:  # (initialised to zero)
        tensors[name] = torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(4))
    save_file(tensors, gpt_oss / "model.safetensors", metadata={"format": "pt"})
    return {
        "qwen3": build_checkpoint(root / "qwen3", "Qwen3ForCausalLM", tokenizer),
        "gpt-oss": gpt_oss,
        "deepseek-v3": build_checkpoint(root / "v3", "DeepseekV3ForCausalLM", tokenizer,
                                        num_kv_heads=4, extra_config=V3),
    }


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _run(path, prompts=PROMPTS, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), progress=False, **options)
    return llm, _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY))


def _tokens_of(path, **options) -> list[list[int]]:
    """The greedy tokens of a fresh engine, shut down after."""
    llm, tokens = _run(path, **options)
    llm.engine.core.shutdown()
    return tokens


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("arch", ["qwen3", "gpt-oss", "deepseek-v3"])
def test_cpu_kernels_give_the_reference_tokens_in_a_quarter_of_the_bytes(checkpoints, arch,
                                                                        kv_cache_dtype):
    """float32 models: the cpu backend (C++ quantizing write and float8 attention, the fused
    rope-attention and one-call decoder stack where they apply) against the torch reference
    backend (quantize_kv, dequantize, SDPA) over the same float8 cache: the same greedy tokens.
    A prefix hit reads the stored float8 blocks and gives them again. The pool holds 4x the
    blocks of a float32 cache in the same memory."""
    path = checkpoints[arch]
    plain, _ = _run(path, prompts=PROMPTS[:1], kv_cache_memory=4 * MiB)
    llm, expected = _run(path, kv_cache_dtype=kv_cache_dtype, attention_backend="torch",
                         kv_cache_memory=4 * MiB)
    assert llm.engine.core.kv.num_blocks // 4 == plain.engine.core.kv.num_blocks
    fast, tokens = _run(path, kv_cache_dtype=kv_cache_dtype, attention_backend="cpu",
                        kv_cache_memory=4 * MiB)
    assert tokens == expected
    again = fast.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert _tokens(again) == expected and again[0].num_cached_tokens == 64
    for engine in (plain, llm, fast):
        engine.engine.core.shutdown()


def test_bf16_model_over_a_float8_cache(checkpoints):
    """A bf16 model's float8 cache: half a bf16 cache's bytes per token; the cpu backend's first
    logprobs within bf16 rounding of the reference backend's; a prefix hit gives a cold run's
    tokens."""
    path = checkpoints["qwen3"]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    firsts = {}
    for backend in ("torch", "cpu"):
        llm = LLM(str(path), dtype="bfloat16", kv_cache_dtype="fp8", attention_backend=backend,
                  kv_cache_memory=4 * MiB, progress=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        firsts[backend] = [o.outputs[0].logprobs[0] for o in outs]
        if backend == "cpu":
            bf16 = LLM(str(path), dtype="bfloat16", kv_cache_memory=4 * MiB, progress=False)
            assert llm.engine.core.kv.num_blocks // 2 == bf16.engine.core.kv.num_blocks
            bf16.engine.core.shutdown()
            cold = _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
            hit = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
            assert _tokens(hit) == cold and hit[0].num_cached_tokens == 64
        llm.engine.core.shutdown()
    for ref, got in zip(firsts["torch"], firsts["cpu"]):
        top = max(ref, key=lambda t: ref[t].logprob)
        assert top in got and abs(got[top].logprob - ref[top].logprob) < 0.05


def test_float8_blocks_through_host_and_file_tiers(checkpoints, tmp_path):
    """float8 blocks move as bytes: evicted to host memory (L2) and back, written to the file
    store (L3) and read by a cold engine, with a cold run's tokens. The store's block layout
    names the dtype: an engine with a float32 cache reads none of them."""
    path = checkpoints["qwen3"]
    _, expected = _run(path, kv_cache_dtype="fp8", enable_prefix_caching=False)
    # 80 float8 blocks; the prompts' tokens then their repeats overflow it (L2 reloads).
    block_bytes = 16 * 2 * 2 * 16 * 2  # tokens x K|V x heads x head_dim x layers, one byte each
    llm, tokens = _run(path, kv_cache_dtype="fp8", kv_cache_memory=8 * block_bytes,
                       max_model_len=96, kv_host_memory=4 * MiB)
    assert tokens == expected
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert _tokens(again) == expected and llm.engine.core.kv.hit_tokens_by_tier["L2"] > 0
    llm.engine.core.check_integrity()
    llm.engine.core.shutdown()
    store = tmp_path / "store"
    writer, tokens = _run(path, kv_cache_dtype="fp8", kv_store_dir=str(store))
    assert tokens == expected
    writer.engine.core.shutdown()
    reader, tokens = _run(path, kv_cache_dtype="fp8", kv_store_dir=str(store))
    assert tokens == expected and reader.engine.core.kv.hit_tokens_by_tier["L3"] == 64 + 32 + 16
    reader.engine.core.shutdown()
    other, _ = _run(path, kv_store_dir=str(store))
    assert other.engine.core.kv.hit_tokens_by_tier["L3"] == 0
    other.engine.core.shutdown()


def test_disaggregated_speculative_and_batch_invariant_runs(checkpoints):
    """float8 KV pulled from a prefill instance to a decode instance (GQA and MLA); n-gram
    speculative decoding (multi-token verification rows over the float8 cache); batch-invariant
    mode (each request alone, then all together): a plain float8 run's tokens."""
    for arch in ("qwen3", "deepseek-v3"):
        path = checkpoints[arch]
        plain, expected = _run(path, kv_cache_dtype="fp8")
        plain.engine.core.shutdown()
        tokens, _, _ = run_disaggregated(path, [{"prompt_token_ids": p} for p in PROMPTS],
                                         dict(temperature=0, max_tokens=12, ignore_eos=True),
                                         kv_cache_dtype="fp8")
        assert [list(t) for t in tokens] == expected
    path = checkpoints["qwen3"]
    repeating = [p[:8] * 6 for p in PROMPTS]  # n-gram drafts that the target sometimes accepts
    plain, expected = _run(path, prompts=repeating, kv_cache_dtype="fp8")
    spec, tokens = _run(path, prompts=repeating, kv_cache_dtype="fp8",
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert tokens == expected
    invariant = LLM(str(path), kv_cache_dtype="fp8", batch_invariant=True, progress=False)
    together = _tokens(invariant.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    alone = [_tokens(invariant.generate([{"prompt_token_ids": p}], GREEDY))[0] for p in PROMPTS]
    assert together == alone
    for engine in (plain, spec, invariant):
        engine.engine.core.shutdown()


def test_checkpoint_kv_scales_reach_the_kernels(checkpoints, tmp_path):
    """``self_attn.k_scale``/``v_scale`` tensors (llm-compressor's format) set each layer's
    scales; the cpu kernels and the reference backend apply them alike, and they change what is
    stored (keys / 0.05 clamp at e4m3's 448)."""
    src = checkpoints["qwen3"]
    path = tmp_path / "scaled"
    path.mkdir()
    for f in src.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.05)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.5 + layer)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    ref, expected = _run(path, kv_cache_dtype="fp8", attention_backend="torch")
    layers = [m for m in ref.engine.core.executor.worker.model.modules() if isinstance(m, Attention)]
    scales = [(a.k_scale, a.v_scale) for a in layers]
    ref.engine.core.shutdown()
    assert scales == [(pytest.approx(0.05), 0.5), (pytest.approx(0.05), 1.5)]
    assert _tokens_of(path, kv_cache_dtype="fp8", attention_backend="cpu") == expected
    assert _tokens_of(checkpoints["qwen3"], kv_cache_dtype="fp8", attention_backend="torch") != expected
    # A cache that is not float8 ignores the scales: the unscaled checkpoint's tokens.
    assert _tokens_of(path) == _tokens_of(checkpoints["qwen3"])


def _with_tensors(src, dst, extra: dict[str, float]):
    """A copy of the checkpoint at ``src`` with scalar tensors added."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors.update({name: torch.tensor(value) for name, value in extra.items()})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_modelopt_and_older_scale_names_and_mla_scales(checkpoints, tmp_path):
    """ModelOpt's ``k_proj.k_scale``/``v_proj.v_scale``, compressed-tensors'
    ``k_proj.output_scale``/``v_proj.output_scale`` and the older single ``kv_scale`` (both K
    and V) are read as vLLM reads them. An MLA layer's one latent cache takes its
    ``k_scale`` (``v_scale`` has no cache there): a scale that clamps the stored entries
    changes the tokens, and the cpu kernels give the reference backend's on it."""
    path = _with_tensors(checkpoints["qwen3"], tmp_path / "modelopt", {
        "model.layers.0.self_attn.k_proj.k_scale": 0.05, "model.layers.0.self_attn.v_proj.v_scale": 0.5,
        "model.layers.1.self_attn.kv_scale": 0.25})
    llm = LLM(str(path), kv_cache_dtype="fp8", progress=False)
    layers = [m for m in llm.engine.core.executor.worker.model.modules() if isinstance(m, Attention)]
    assert [(a.k_scale, a.v_scale) for a in layers] == [(pytest.approx(0.05), 0.5), (0.25, 0.25)]
    llm.engine.core.shutdown()
    path = _with_tensors(checkpoints["gpt-oss"], tmp_path / "compressed", {
        "model.layers.0.self_attn.k_proj.output_scale": 0.125,
        "model.layers.0.self_attn.v_proj.output_scale": 4.0})
    llm = LLM(str(path), kv_cache_dtype="fp8", progress=False)
    layers = [m for m in llm.engine.core.executor.worker.model.modules() if isinstance(m, Attention)]
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.125, 4.0), (1.0, 1.0)]
    llm.engine.core.shutdown()

    src = checkpoints["deepseek-v3"]
    prefixes = [n.removesuffix("kv_a_proj_with_mqa.weight") for n in load_file(src / "model.safetensors")
                if n.endswith("self_attn.kv_a_proj_with_mqa.weight")]
    path = _with_tensors(src, tmp_path / "mla", {**{p + "k_scale": 0.001 for p in prefixes},
                                                 **{p + "v_scale": 7.0 for p in prefixes}})
    ref, expected = _run(path, kv_cache_dtype="fp8", attention_backend="torch")
    mla = [m for m in ref.engine.core.executor.worker.model.modules() if isinstance(m, MLAAttention)]
    assert len(mla) == len(prefixes) > 0 and all(m.kv_scale == pytest.approx(0.001) for m in mla)
    ref.engine.core.shutdown()
    assert _tokens_of(path, kv_cache_dtype="fp8", attention_backend="cpu") == expected
    assert _tokens_of(src, kv_cache_dtype="fp8", attention_backend="torch") != expected


def test_refused_by_name(checkpoints, make_checkpoint):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        LLM(str(checkpoints["qwen3"]), kv_cache_dtype="int8", progress=False)
    v4 = make_checkpoint("DeepseekV4ForCausalLM", extra_config=DEEPSEEK_V4, num_layers=4, num_heads=4,
                         num_kv_heads=1, head_dim=32, intermediate_size=32)
    randomize_v4(v4)
    with pytest.raises(ValueError, match="DeepseekV4ForCausalLM's caches cannot be float8"):
        LLM(str(v4), kv_cache_dtype="fp8", progress=False)
