"""ArchConfig.from_hf: the defaults, aliases and per-layer windows that model files no longer
work out from config.json themselves."""

from __future__ import annotations

import math

import pytest

from openinfer.models.arch import CSA, HCA, SLIDING, ArchConfig

LLAMA = {"vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
         "max_position_embeddings": 128, "intermediate_size": 96}


def test_a_minimal_config_takes_the_defaults():
    arch = ArchConfig.from_hf(LLAMA)
    assert (arch.num_kv_heads, arch.head_dim, arch.rms_norm_eps, arch.hidden_act) == (8, 8, 1e-6, "silu")
    assert not (arch.attention_bias or arch.mlp_bias or arch.tie_word_embeddings)
    assert arch.sliding_windows == (None,) * 4
    assert (arch.rope.theta, arch.rope.scaling, arch.rope.max_position) == (10000.0, None, 128)
    assert arch.moe.num_experts == 0 and arch.num_mtp_layers == 0


def test_rope_reads_transformers_5_rope_parameters():
    params = {"rope_type": "default", "rope_theta": 5e5}
    arch = ArchConfig.from_hf({**LLAMA, "rope_parameters": params})
    assert (arch.rope.theta, arch.rope.scaling) == (5e5, params)


@pytest.mark.parametrize(("extra", "windows"), [
    ({"sliding_window": 16}, (16,) * 4),  # Mistral: every layer
    ({"sliding_window": 16, "use_sliding_window": False, "max_window_layers": 2}, (None,) * 4),
    ({"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 2}, (None, None, 16, 16)),
    ({"sliding_window": 16, "layer_types": [SLIDING, "full_attention"] * 2}, (16, None, 16, None)),
])
def test_sliding_windows_per_layer(extra, windows):
    assert ArchConfig.from_hf({**LLAMA, **extra}).sliding_windows == windows


@pytest.mark.parametrize("key", ["n_routed_experts", "num_experts", "num_local_experts"])
def test_routed_experts_under_any_name(key):
    arch = ArchConfig.from_hf({**LLAMA, key: 8, "num_experts_per_tok": 2})
    assert (arch.moe.num_experts, arch.moe.top_k) == (8, 2)


def test_mla_softmax_scale_takes_yarn_mscale():
    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64}
    hf = {**LLAMA, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
          "kv_lora_rank": 32, "q_lora_rank": None, "rope_scaling": yarn}
    mla = ArchConfig.from_hf(hf).mla()
    mscale = 0.1 * math.log(40.0) + 1.0
    assert mla.q_lora_rank == 0 and mla.latent_dim == 32
    assert mla.scale == pytest.approx(24**-0.5 * mscale * mscale)


def test_deepseek_v4_parts_and_defaults():
    hf = {**LLAMA, "head_dim": 128, "layer_types": [SLIDING, CSA, HCA, CSA], "sliding_window": 8,
          "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "compress_rates": {HCA: 8}}
    v4 = ArchConfig.from_hf(hf).deepseek_v4()
    assert v4.compress_rates == {CSA: 4, HCA: 8}
    assert v4.mlp_layer_types == ("hash_moe",) * 3 + ("moe",)
    assert (v4.rope_dim, v4.main_rope_theta, v4.compress_rope_theta) == (64, 10000.0, 160000.0)
    assert (v4.hc_mult, v4.routed_scaling_factor, v4.swiglu_limit) == (4, 1.5, 10.0)
