"""DeepSeek-V2/V3 (MLA + DeepSeekMoE) match transformers on tiny random checkpoints: prefill
(expanded MLA) and decode (absorbed MLA) logits on every attention backend, greedy generation
through the engine, and the latent KV cache the engine allocates for them."""

from __future__ import annotations

import pytest
import torch
from attention_support import ATTENTION_BACKENDS
from conftest import quantize_blocks
from test_hf_parity import BLOCK, PagedModel, _hf_logits, _prompts

from openinfer import LLM, SamplingParams
from openinfer.kv.spec import MLALatentSpec
from openinfer.layers.linear import GemmLayer

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
           moe_intermediate_size=32, num_experts_per_tok=2)
CONFIGS = {
    # V2-Lite's shape: no q LoRA, softmax greedy routing, one dense layer first.
    "v2-lite": ("DeepseekV2ForCausalLM", dict(MLA, q_lora_rank=None, n_routed_experts=8,
                                              n_shared_experts=1, first_k_dense_replace=1,
                                              topk_method="greedy", routed_scaling_factor=1.0)),
    "v2-grouped": ("DeepseekV2ForCausalLM", dict(MLA, q_lora_rank=24, n_routed_experts=8,
                                                 n_shared_experts=2, first_k_dense_replace=0,
                                                 topk_method="group_limited_greedy", n_group=4,
                                                 topk_group=2, routed_scaling_factor=2.0)),
    "v3": ("DeepseekV3ForCausalLM", dict(MLA, q_lora_rank=24, n_routed_experts=8, n_shared_experts=1,
                                         first_k_dense_replace=1, n_group=4, topk_group=2,
                                         norm_topk_prob=True, routed_scaling_factor=2.5)),
    "v3-neox-rope-yarn": ("DeepseekV3ForCausalLM", dict(
        MLA, q_lora_rank=24, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, norm_topk_prob=True, rope_interleave=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
}


def _checkpoint(make_checkpoint, name: str, **kwargs):
    arch, extra = CONFIGS[name]
    extra = dict(extra)
    scaling = extra.pop("rope_scaling", None)
    # MLA: transformers reads num_key_value_heads as the number of heads (no grouping).
    path = make_checkpoint(arch, extra_config=extra, rope_scaling=scaling, num_kv_heads=4, **kwargs)
    if name.startswith("v3"):  # a bias large enough to change which experts win
        _perturb_correction_bias(path)
    return path


def _perturb_correction_bias(path) -> None:
    from safetensors.torch import load_file, save_file

    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(3)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = 0.3 * torch.randn(t.shape, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("attention", ATTENTION_BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_decode_logits_match_transformers(name, attention, make_checkpoint,
                                                      hf_model_loader):
    path = _checkpoint(make_checkpoint, name)
    ours, hf = PagedModel(path, attention=attention), hf_model_loader(path)
    a, b, c = _prompts(ours.config.vocab_size, [23, 11, 9])
    got = {0: [], 1: [], 2: []}

    def run(chunks):
        out, offset = ours.step(chunks), 0
        for sid, tokens, _ in chunks:
            got[sid].append(out[offset:offset + len(tokens)])
            offset += len(tokens)

    run([(0, a[:9], 0), (1, b, 0)])                   # fresh prefills (expanded)
    run([(0, a[9:17], 9), (2, c[:4], 0)])             # a continuation over cached latents
    for i in range(17, 23):                           # decodes (absorbed) beside a prefill
        run([(0, a[i:i + 1], i)] + ([(2, c[4:], 4)] if i == 17 else []))
    for sid, prompt in enumerate((a, b, c)):
        torch.testing.assert_close(torch.cat(got[sid]), _hf_logits(hf, prompt), atol=5e-5, rtol=1e-4)


def test_the_engine_caches_one_latent_entry_per_token(make_checkpoint):
    path = _checkpoint(make_checkpoint, "v3")
    llm = LLM(str(path), block_size=BLOCK, kv_cache_memory=1 << 20, progress=False)
    (group,) = llm.engine.core.kv.groups
    assert group.spec == MLALatentSpec(BLOCK, 32, 16, "float32")
    # 48 floats per token and layer (a GQA cache of the same width with 4 heads of 40: 320).
    assert group.spec.bytes_per_block == BLOCK * 48 * 4


@pytest.mark.parametrize("name", ["v2-lite", "v3"])
def test_greedy_generation_matches_transformers(name, make_checkpoint, hf_model_loader):
    """Every greedy token is the argmax of transformers' no-cache forward over the prompt and
    the tokens before it. (Its cached ``generate`` is not the reference: on the v3 config it
    parts from its own no-cache forward after ~19 tokens of one prompt, while ours agrees.)"""
    path = _checkpoint(make_checkpoint, name)
    llm = LLM(str(path), block_size=BLOCK, progress=False)
    hf = hf_model_loader(path)
    prompts = _prompts(llm.engine.inputs.vocab_size, [3, 17, 40, 8], seed=7)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        logits = _hf_logits(hf, prompt + tokens)[len(prompt) - 1:-1]
        assert tokens == logits.argmax(-1).tolist()
    # Prefix-cache hits: the same prompts again read their cached latent blocks.
    again = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert sum(o.num_cached_tokens or 0 for o in again) > 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("fp8_weights,scale_fmt", [("keep", None), ("dequantize", None),
                                                   ("keep", "ue8m0")])
def test_fp8_block_quantized_checkpoint_with_an_mtp_layer(fp8_weights, scale_fmt, make_checkpoint,
                                                          hf_model_loader, tmp_path, monkeypatch):
    """DeepSeek-V3's release format: fp8 linear weights with a weight_scale_inv per 16x16 tile
    here (128x128 there, partial edge tiles included), and the MTP module as layer
    num_hidden_layers; scales in float32, or powers of two in ue8m0 (float8_e8m0fnu, as
    V3.1 and V4 store them). Linear layers hold the fp8 bytes and scales as loaded (or, with
    OPENINFER_FP8_WEIGHTS=dequantize, their products), and so do the routed experts (packed
    for the fused kernel as bytes). Prefill logits match transformers on the dequantized
    weights, and so does every greedy token of decodes through the engine (the fp8 kernels'
    rows); the MTP weights land in the kept module."""
    monkeypatch.setenv("OPENINFER_FP8_WEIGHTS", fp8_weights)
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from openinfer.kernels.fp8_gemm import dequantize

    path = _checkpoint(make_checkpoint, "v3")
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    g = torch.Generator().manual_seed(5)
    mtp = {f"model.layers.{n}.{k.split('.', 3)[3]}": v.clone() for k, v in tensors.items()
           if k.startswith(f"model.layers.{n - 1}.")}  # a decoder block like the last one
    hidden = tensors["model.norm.weight"].shape[0]
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    for part, shape in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                        ("eh_proj.weight", (hidden, 2 * hidden)), ("embed_tokens.weight", (vocab, hidden)),
                        ("shared_head.norm.weight", (hidden,)), ("shared_head.head.weight", (vocab, hidden))):
        mtp[f"model.layers.{n}.{part}"] = 0.05 * torch.randn(shape, generator=g)
    quantized, dequantized = {}, {}
    for name, t in {**tensors, **mtp}.items():
        if t.dim() == 2 and name.endswith("proj.weight"):
            q, scale = quantize_blocks(t, 16, ue8m0=scale_fmt == "ue8m0")
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize(q, scale, (16, 16))
        else:
            quantized[name] = dequantized[name] = t
    save_file({k: v for k, v in dequantized.items() if k not in mtp}, file, metadata={"format": "pt"})
    fp8_path = tmp_path / "fp8"
    shutil.copytree(path, fp8_path)
    save_file(quantized, fp8_path / file.name, metadata={"format": "pt"})
    config = json.loads((fp8_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16],
                                     **({"scale_fmt": scale_fmt} if scale_fmt else {})}
    config["num_nextn_predict_layers"] = 1
    (fp8_path / "config.json").write_text(json.dumps(config))

    ours, hf = PagedModel(fp8_path), hf_model_loader(path)
    attn = ours.model.model.layers[1].self_attn
    held = {name: m.weight.dtype for name, m in ours.model.named_modules() if isinstance(m, GemmLayer)}
    if fp8_weights == "keep":
        assert attn.o_proj.fp8_block == (16, 16) and attn.o_proj.weight.dtype == torch.float8_e4m3fn
        assert sum(d == torch.float8_e4m3fn for d in held.values()) >= 4 * n, held
        assert held["lm_head"] == torch.float32  # not quantized in the checkpoint
        assert torch.equal(attn.o_proj.weight.view(torch.uint8),
                           quantized["model.layers.1.self_attn.o_proj.weight"].view(torch.uint8))
    else:
        assert set(held.values()) == {torch.float32}
    experts = ours.model.model.layers[1].mlp.experts  # (unbound: the torch path)
    assert experts.w13.dtype == (torch.float8_e4m3fn if fp8_weights == "keep" else torch.float32)
    (prompt,) = _prompts(ours.config.vocab_size, [21])
    torch.testing.assert_close(ours.step([(0, prompt, 0)]), _hf_logits(hf, prompt), atol=5e-5, rtol=1e-4)
    (layer,) = ours.model.model.mtp
    torch.testing.assert_close(layer.eh_proj.dense_weight(), dequantized[f"model.layers.{n}.eh_proj.weight"])
    torch.testing.assert_close(layer.block.self_attn.kv_b_proj.dense_weight(),
                               dequantized[f"model.layers.{n}.self_attn.kv_b_proj.weight"])
    torch.testing.assert_close(layer.shared_head.head.weight,
                               mtp[f"model.layers.{n}.shared_head.head.weight"])
    llm = LLM(str(fp8_path), block_size=BLOCK, progress=False)
    assert llm.engine.core.compute_info["gemm"].endswith("+fp8") == (fp8_weights == "keep")
    bound = llm.engine.core.executor.worker.model.model.layers[1].mlp.experts
    assert bound.packed.w13.dtype == (torch.float8_e4m3fn if fp8_weights == "keep" else torch.float32)
    assert llm.engine.core.compute_info["experts"] == ("cpu+fp8" if fp8_weights == "keep" else "cpu")
    prompts = _prompts(llm.engine.inputs.vocab_size, [3, 17, 9], seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        logits = _hf_logits(hf, prompt + tokens)[len(prompt) - 1:-1]
        assert tokens == logits.argmax(-1).tolist()

    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (fp8_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        PagedModel(fp8_path)
