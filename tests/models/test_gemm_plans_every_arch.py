"""Every registered architecture, fp32 and bf16, through the CPU GEMM plans: the plan this CPU
picks (``auto``) and each path
forced, greedy tokens equal to the plain path's (no plans: F.linear). A plan may pack a
weight and free the plain copy, so a module that reads a planned layer's weight directly
(MLA's absorbed decode did) fails here."""

from __future__ import annotations

import pytest
from conftest import CHECKPOINTS, randomize_v4
from test_deepseek import CONFIGS as DEEPSEEK_CONFIGS
from test_moe import MOE_CONFIGS
from test_window_models import WINDOW_MODELS
from v41_checkpoint import build_v41_checkpoint

from openinfer import LLM, SamplingParams
from openinfer.kernels import gemm_plan
from openinfer.kernels.gemm_paths import PATHS
from openinfer.models.registry import MODEL_REGISTRY

_DEEPSEEK_V2 = DEEPSEEK_CONFIGS["v2-lite"][1]  # V2-Lite's shape: no q LoRA, a dense first layer
_DEEPSEEK_V3 = DEEPSEEK_CONFIGS["v3"][1]
_V4 = {k: v for k, v in CHECKPOINTS["deepseek_v4"].items() if k != "arch"}
ARCH_CHECKPOINTS: dict[str, dict] = {
    "LlamaForCausalLM": dict(num_kv_heads=1, tie_word_embeddings=True,
                             extra_config={"attention_bias": True, "mlp_bias": True}),
    "MistralForCausalLM": dict(num_layers=3, extra_config=WINDOW_MODELS["MistralForCausalLM"][1]),
    "Qwen2ForCausalLM": dict(),
    "Qwen3ForCausalLM": dict(),
    "MixtralForCausalLM": dict(extra_config=MOE_CONFIGS["MixtralForCausalLM"]),
    "Qwen3MoeForCausalLM": dict(extra_config=MOE_CONFIGS["Qwen3MoeForCausalLM"]),
    "DeepseekV2ForCausalLM": dict(num_kv_heads=4, extra_config=_DEEPSEEK_V2),
    "DeepseekV3ForCausalLM": dict(num_kv_heads=4, extra_config=_DEEPSEEK_V3),
    "DeepseekV4ForCausalLM": _V4,
    "DeepseekV41ForCausalLM": {},  # DeepInfer's release format (fp8 projections, MXFP4 experts)
    "GptOssForCausalLM": dict(num_layers=3, extra_config=WINDOW_MODELS["GptOssForCausalLM"][1]),
    "Gemma2ForCausalLM": dict(num_layers=3, extra_config=WINDOW_MODELS["Gemma2ForCausalLM"][1]),
}
PROMPTS = [[5, 9, 13, 200, 31, 7, 77], list(range(40, 61))]
TOKENS = 6
TIE = {"float32": 1e-3, "bfloat16": 0.25}
"""The plain path's logprob gap between its top token and another below which either may win.
bf16: these random models' next-token distributions are flat (the top 20 within ~0.3 nats) and
a bf16 rounding may flip a MoE router's choice; GptOss under ``auto`` measured 0.20."""


def test_every_registered_architecture_is_covered():
    assert set(ARCH_CHECKPOINTS) == set(MODEL_REGISTRY)


def _greedy(path, dtype: str, mode: str, monkeypatch) -> list:
    monkeypatch.setenv(gemm_plan.ENV_VAR, mode)
    llm = LLM(str(path), dtype=dtype, kv_cache_memory=16 << 20, progress=False)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, logprobs=20, ignore_eos=True)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params)]


def _assert_same_greedy(ours, plain, dtype: str, label: str) -> None:
    """Token for token, up to the first position where the plain path's top two were a tie
    (within TIE) and ours took the other: a tie in the reference is not a bug in us."""
    for seq, (a, b) in enumerate(zip(ours, plain)):
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x == y:
                continue
            top = b.logprobs[i]
            assert x in top, f"{label}: prompt {seq} token {i}: {x} is not in the plain top 20 {top}"
            gap = top[y].logprob - top[x].logprob
            assert gap < TIE[dtype], f"{label}: prompt {seq} token {i}: {x} != {y} (gap {gap:.4f})"
            break


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", sorted(MODEL_REGISTRY))
def test_gemm_plans_keep_greedy_tokens(arch, dtype, make_checkpoint, monkeypatch, tmp_path):
    if arch == "DeepseekV41ForCausalLM":
        path = build_v41_checkpoint(tmp_path / "v41")
    else:
        path = make_checkpoint(arch, **ARCH_CHECKPOINTS[arch])
    if arch == "DeepseekV4ForCausalLM":
        randomize_v4(path)
    plain = _greedy(path, dtype, "default", monkeypatch)
    ran = []
    for mode in ["auto", *PATHS]:
        try:
            ours = _greedy(path, dtype, mode, monkeypatch)
        except ValueError as e:  # a forced path with no kernel for this dtype/shape on this CPU
            assert f"{gemm_plan.ENV_VAR}={mode}" in str(e)
            continue
        _assert_same_greedy(ours, plain, dtype, f"{arch} {dtype} {mode}")
        ran.append(mode)
    assert "auto" in ran and "torch_t" in ran, ran
    if dtype == "float32":  # oneDNN packs fp32 on every x86-64 CPU (bf16 only with AVX-512)
        assert "onednn_packed" in ran, ran
