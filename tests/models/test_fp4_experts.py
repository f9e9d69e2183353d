"""DeepSeek-V4 in its release format: block-scaled fp8 projections whose scales are named
``<module>.scale``, and routed experts in MXFP4 (``"expert_dtype": "fp4"``: two e2m1 values
per byte, one power-of-two scale per 32 inputs). transformers' own FP8/FP4 dequantizer
(``Fp8Dequantize``) is the reference for the format: the engine on the release checkpoint
gives the greedy tokens of transformers' model on the same values multiplied out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DEEPSEEK_V4, mxfp4, quantize_blocks, randomize_v4
from safetensors.torch import load_file, save_file
from test_gemm_plans_every_arch import _V4, _assert_same_greedy, _greedy
from test_hf_parity import _hf_logits, _prompts
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from openinfer import LLM, SamplingParams
from openinfer.kernels import gemm_plan
from openinfer.kernels.gemm_paths import PATHS
from openinfer.layers.moe import FusedExperts
from openinfer.models.fp8 import block_size_of, dequantize_fp4

FP8_PROJECTIONS = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight",
                   "attn.wo_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
                   "shared_experts.w3.weight")
"""The projections V4's release holds in fp8 (the routed experts are FP4)."""
BLOCK = 32


def release_checkpoints(src: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(the V4 checkpoint at ``src`` in the release format, a float32 copy holding the values
    transformers' dequantizer reads out of it)."""
    release, plain = tmp_path / "release", tmp_path / "plain"
    shutil.copytree(src, release)
    shutil.copytree(src, plain)
    reference = Fp8Dequantize(None)
    for file in src.glob("*.safetensors"):
        quantized, dequantized = {}, {}
        for name, t in load_file(file).items():
            if ".experts." in name and ".shared_experts." not in name and name.endswith(".weight"):
                q, s = mxfp4(t)
            elif name.endswith(FP8_PROJECTIONS):
                q, s = quantize_blocks(t, BLOCK, ue8m0=True)
            else:
                quantized[name] = dequantized[name] = t
                continue
            module = name.removesuffix(".weight")
            quantized[name], quantized[f"{module}.scale"] = q, s
            dequantized[name] = reference._dequantize_one(q, s, torch.float32)
        save_file(quantized, release / file.name, metadata={"format": "pt"})
        save_file(dequantized, plain / file.name, metadata={"format": "pt"})
    config = json.loads((release / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    (release / "config.json").write_text(json.dumps(config))
    return release, plain


def test_mxfp4_dequantization_is_transformers():
    g = torch.Generator().manual_seed(0)
    packed = torch.arange(256, dtype=torch.uint8).repeat(8, 1).view(torch.int8)  # every byte
    exponents = torch.randint(120, 134, (8, 512 // 32), generator=g, dtype=torch.uint8)
    scale = exponents.view(torch.float8_e8m0fnu)
    want = Fp8Dequantize(None)._dequantize_one(packed, scale, torch.float32)
    assert torch.equal(dequantize_fp4(packed, scale), want)
    assert torch.equal(dequantize_fp4(packed.view(torch.uint8), scale), want)


def test_release_format_gives_transformers_tokens(make_checkpoint, hf_model_loader, tmp_path):
    src = make_checkpoint("DeepseekV4ForCausalLM", extra_config=DEEPSEEK_V4, num_layers=4,
                          num_heads=4, num_kv_heads=1, head_dim=32, intermediate_size=32,
                          max_position_embeddings=4096)
    randomize_v4(src)
    release, plain = release_checkpoints(src, tmp_path)
    stored = load_file(next(release.glob("*.safetensors")))
    assert stored["model.layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert stored["model.layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = _prompts(1000, [23, 9], seed=5)
    llm = LLM(str(release), block_size=4, progress=False)
    experts = [m for m in llm.engine.core.executor.worker.model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.packed.w13.dtype == torch.uint8 for m in experts)  # kept: half a byte each
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    hf = hf_model_loader(plain)
    for prompt, tokens in zip(prompts, outs):  # transformers' argmax after each prefix
        assert tokens == _hf_logits(hf, prompt + tokens)[len(prompt) - 1:-1].argmax(-1).tolist()
    llm.engine.check_integrity()


def test_an_unknown_expert_dtype_is_refused_by_name():
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "int4"}
    with pytest.raises(ValueError, match="expert_dtype 'int4' is not supported"):
        block_size_of({"quantization_config": quant})
    assert block_size_of({"quantization_config": {**quant, "expert_dtype": "fp4"}}) == (128, 128)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_release_format_on_every_gemm_path(dtype, make_checkpoint, tmp_path, monkeypatch):
    """In fp32 and bf16, with the GEMM plan this CPU picks and each path forced (its fp8 linears
    and FP4 experts kept as loaded), the release checkpoint gives the plain
    path's greedy tokens on the float copy (no plans: F.linear), up to a tie there."""
    src = make_checkpoint("DeepseekV4ForCausalLM", **_V4)
    randomize_v4(src)
    release, plain_copy = release_checkpoints(src, tmp_path)
    plain = _greedy(plain_copy, dtype, "default", monkeypatch)
    ran = []
    for mode in ["auto", *PATHS]:
        try:
            ours = _greedy(release, dtype, mode, monkeypatch)
        except ValueError as e:  # a forced path with no kernel for this dtype/shape on this CPU
            assert f"{gemm_plan.ENV_VAR}={mode}" in str(e)
            continue
        _assert_same_greedy(ours, plain, dtype, f"fp4 release {dtype} {mode}")
        ran.append(mode)
    assert "auto" in ran and "torch_t" in ran, ran
