"""MoE models through the engine on the cpu backend (the fused MoE kernel, with the extension's
attention and elementwise kernels) give the greedy tokens of the torch backend (the experts'
Python loop), float32 and bfloat16, ties allowed as for the GEMM plans."""

from __future__ import annotations

import pytest
from test_deepseek import CONFIGS as DEEPSEEK_CONFIGS
from test_gemm_plans_every_arch import PROMPTS, TOKENS, _assert_same_greedy
from test_moe import MOE_CONFIGS

from openinfer import LLM, SamplingParams
from openinfer.layers.moe import FusedExperts

CHECKPOINTS = {
    "Qwen3MoeForCausalLM": dict(extra_config=dict(MOE_CONFIGS["Qwen3MoeForCausalLM"], num_experts=16,
                                                  num_experts_per_tok=4, moe_intermediate_size=40)),
    "DeepseekV2ForCausalLM": dict(num_kv_heads=4, extra_config=DEEPSEEK_CONFIGS["v2-lite"][1]),
}
"""Qwen3-MoE with 16 experts of 40 features (not a whole number of tiles); DeepSeek-V2-Lite's
shape (no q LoRA, shared experts, a dense first layer)."""


def _greedy(path, dtype: str, backend: str) -> tuple[list, list[str]]:
    llm = LLM(str(path), dtype=dtype, attention_backend=backend, kv_cache_memory=16 << 20, progress=False)
    experts = [m for m in llm.engine.core.executor.worker.model.modules() if isinstance(m, FusedExperts)]
    params = SamplingParams(max_tokens=TOKENS, temperature=0, logprobs=20, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    return outs, sorted({m.forward_path for m in experts})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", list(CHECKPOINTS))
def test_cpu_backend_keeps_the_torch_backends_greedy_tokens(arch, dtype, make_checkpoint):
    path = make_checkpoint(arch, **CHECKPOINTS[arch])
    plain, plain_paths = _greedy(path, dtype, "torch")
    ours, paths = _greedy(path, dtype, "cpu")
    assert plain_paths == ["forward_native"] and paths == ["forward_cpu"]
    _assert_same_greedy(ours, plain, dtype, f"{arch} {dtype}")
