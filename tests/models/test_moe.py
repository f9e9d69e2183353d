"""Mixture-of-experts models and layers match transformers: routers operation by operation
(ties included), the grouped expert execution, and Mixtral / Qwen3-MoE end to end."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_hf_parity import PagedModel, _hf_logits, _prompts

from openinfer import LLM, SamplingParams
from openinfer.kernels.custom_op import Platform
from openinfer.layers.moe import FusedExperts
from openinfer.layers.moe_router import Router, RoutingConfig

MOE_CONFIGS = {
    "MixtralForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2),
    # Layer 0 dense (mlp_only_layers), layer 1 sparse; weights renormalised.
    "Qwen3MoeForCausalLM": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True),
}
SPARSE_STEP_2 = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False)
"""Qwen3-MoE without renormalisation, MoE on every second layer (layer 1 of 0..2)."""


def _sorted_by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def _check_router(ours: Router, theirs: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
        if hasattr(theirs, "e_score_correction_bias"):
            ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
        _, want_w, want_ids = theirs(x)
        got_w, got_ids = ours(x)
    got_w, got_ids = _sorted_by_expert(got_w, got_ids)
    want_w, want_ids = _sorted_by_expert(want_w.float(), want_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("norm", [False, True])
def test_softmax_greedy_router_matches_qwen3_moe(norm):
    config = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                         norm_topk_prob=norm)
    theirs = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(theirs.weight, std=0.5)
    ours = Router(32, RoutingConfig(num_experts=16, top_k=4, renormalize=norm))
    _check_router(ours, theirs, torch.randn(50, 32))


def test_group_limited_greedy_router_matches_deepseek_v2():
    config = transformers.DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3,
                                           n_group=4, topk_group=2, topk_method="group_limited_greedy",
                                           routed_scaling_factor=2.5)
    theirs = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(theirs.weight, std=0.5)
    ours = Router(32, RoutingConfig(num_experts=16, top_k=3, method="group_limited_greedy",
                                    num_groups=4, topk_groups=2, scaling=2.5, fp32_logits=True))
    _check_router(ours, theirs, torch.randn(50, 32))


@pytest.mark.parametrize("norm", [False, True])
def test_noaux_tc_router_matches_deepseek_v3(norm):
    config = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                                           n_group=4, topk_group=2, norm_topk_prob=norm,
                                           routed_scaling_factor=2.5)
    theirs = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(theirs.weight, std=0.5)
    with torch.no_grad():  # a bias large enough to change which experts win
        theirs.e_score_correction_bias.copy_(0.3 * torch.randn(16))
    ours = Router(32, RoutingConfig(num_experts=16, top_k=4, scoring="sigmoid", method="noaux_tc",
                                    num_groups=4, topk_groups=2, renormalize=norm, scaling=2.5,
                                    fp32_logits=True))
    _check_router(ours, theirs, torch.randn(50, 32))


def test_unsupported_routing_options_are_named():
    with pytest.raises(ValueError, match="topk_method 'sparsemixer'"):
        RoutingConfig(num_experts=8, top_k=2, method="sparsemixer")
    with pytest.raises(ValueError, match="scoring_func 'sqrtsoftplus'"):
        RoutingConfig(num_experts=8, top_k=2, scoring="sqrtsoftplus")
    with pytest.raises(ValueError, match="n_group 3"):
        RoutingConfig(num_experts=8, top_k=2, method="noaux_tc", num_groups=3)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-small-gemm"])
def test_fused_experts_match_a_loop_over_tokens_and_count_them(kernels):
    torch.manual_seed(0)
    experts = FusedExperts(6, 16, 24)
    if kernels:
        from openinfer.kernels.cpu_attention import load_cpu_attention

        if load_cpu_attention() is None:
            pytest.skip("the CPU kernel extension cannot be built here")
        experts.gemm.bind(Platform("cpu", load_cpu_attention()))
    with torch.no_grad():
        experts.w13.normal_(std=0.3)
        experts.w2.normal_(std=0.3)
    x = torch.randn(9, 16)
    weights = torch.rand(9, 2)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(9)])
    ids[0] = torch.tensor([5, 3])  # an expert few tokens chose, and one nobody chose below
    ids[ids == 1] = 0
    experts.count_tokens()
    got = experts(x, weights, ids)
    want = torch.zeros_like(x)
    for t in range(9):
        for j in range(2):
            gate, up = (experts.w13[ids[t, j]] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (experts.w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    counts = experts.token_counts.tolist()
    assert counts == torch.bincount(ids.flatten(), minlength=6).tolist() and counts[1] == 0
    experts(x, weights, ids)  # a running total
    assert experts.token_counts.tolist() == [2 * c for c in counts]


@pytest.mark.parametrize("arch,extra", [*MOE_CONFIGS.items(), ("Qwen3MoeForCausalLM", SPARSE_STEP_2)],
                         ids=[*MOE_CONFIGS, "Qwen3Moe-sparse-step-2"])
def test_moe_prompt_and_decode_logits_match_transformers(arch, extra, make_checkpoint, hf_model_loader):
    path = make_checkpoint(arch, extra_config=extra, num_layers=3)
    ours, hf = PagedModel(path), hf_model_loader(path)
    kinds = [type(layer.mlp).__name__ for layer in ours.model.model.layers]
    want = ["GatedMLP", "MoE", "GatedMLP"] if extra is SPARSE_STEP_2 else \
        ["GatedMLP" if i in extra.get("mlp_only_layers", []) else "MoE" for i in range(3)]
    assert kinds == want
    a, b = _prompts(ours.config.vocab_size, [23, 11])
    first = ours.step([(0, a[:15], 0), (1, b, 0)])
    rest = [ours.step([(0, a[i:i + 1], i)]) for i in range(15, 23)]  # decodes
    torch.testing.assert_close(torch.cat([first[:15], *rest]), _hf_logits(hf, a), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(first[15:], _hf_logits(hf, b), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_moe_greedy_generation_matches_transformers(arch, make_checkpoint, hf_model_loader):
    path = make_checkpoint(arch, extra_config=MOE_CONFIGS[arch])
    llm = LLM(str(path), block_size=4, progress=False)
    hf = hf_model_loader(path)
    prompts = _prompts(llm.engine.inputs.vocab_size, [3, 17, 40, 8], seed=7)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(prompt):]
        assert out.outputs[0].token_ids == ref.tolist()
    llm.engine.check_integrity()


def test_batch_invariant_mode_refuses_moe_models(make_checkpoint):
    path = make_checkpoint("MixtralForCausalLM", extra_config=MOE_CONFIGS["MixtralForCausalLM"])
    with pytest.raises(ValueError, match="batch_invariant: not supported for MixtralForCausalLM"):
        LLM(str(path), batch_invariant=True, progress=False)


def test_expert_token_counts_reach_the_stats_and_metrics(make_checkpoint):
    from openinfer.server.metrics import ServerMetrics

    path = make_checkpoint("Qwen3MoeForCausalLM", extra_config=MOE_CONFIGS["Qwen3MoeForCausalLM"])
    plain = LLM(str(path), progress=False)
    assert "moe_expert_tokens" not in plain.engine.core.stats()  # off unless asked
    llm = LLM(str(path), moe_expert_stats=True, progress=False)
    prompts = _prompts(llm.engine.inputs.vocab_size, [9, 14], seed=3)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    stats = llm.engine.core.stats()
    counts = stats["moe_expert_tokens"]
    # Layer 0 is dense (mlp_only_layers); layer 1 routes each of the 23 prompt tokens and the
    # 2 x 4 decoded ones to 3 experts.
    assert list(counts) == ["1"] and len(counts["1"]) == 8
    assert sum(counts["1"]) == (9 + 14 + 2 * 4) * 3
    text = ServerMetrics(lambda: stats, model_name="tiny").render().decode()
    assert 'moe_expert_tokens_total{engine="0",expert="0",layer="1",model_name="tiny"}' in text
    dense = make_checkpoint("Qwen3ForCausalLM")
    with pytest.raises(ValueError, match="moe_expert_stats: Qwen3ForCausalLM has no MoE layers"):
        LLM(str(dense), moe_expert_stats=True, progress=False)
