"""RotaryEmbedding vs. Hugging Face's Llama RoPE (LlamaRotaryEmbedding + apply_rotary_pos_emb)."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from openinfer.layers.rotary import SUPPORTED_ROPE_TYPES, RotaryEmbedding, get_rope

HEAD_DIM = 64
MAX_POS = 4096
THETA = 500000.0

CASES = {
    "none": None,
    "default": {"rope_type": "default"},
    "legacy_type_key": {"type": "linear", "factor": 2.0},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn_betas_no_truncate": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn_mscale": {  # DeepSeek-style: mscale == mscale_all_dim gives attention factor 1
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "yarn_mscale_ratio": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 256,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "yarn_mscale_only": {  # mscale without mscale_all_dim falls back to get_mscale(factor)
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "mscale": 0.707,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "attention_factor": 0.8,
    },
}


def _hf_config(scaling: dict | None, head_dim: int = HEAD_DIM, **kwargs) -> LlamaConfig:
    params = dict(scaling or {})
    params["rope_theta"] = THETA
    params.setdefault("rope_type", params.pop("type", "default"))
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=MAX_POS,
        rope_parameters=params,
        **kwargs,
    )


def _hf_reference(scaling, positions, q, k):
    rope = LlamaRotaryEmbedding(_hf_config(scaling))
    # HF works on [batch, seq, heads, dim] here (unsqueeze_dim=2); we have no batch dim.
    cos, sin = rope(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)
    return q_ref[0], k_ref[0]


def _random_qk(num_tokens: int = 37, head_dim: int = HEAD_DIM, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen)
    positions[:3] = torch.tensor([0, 1, MAX_POS - 1])  # include both ends of the cache
    q = torch.randn(num_tokens, 8, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, 2, head_dim, generator=gen).to(dtype)
    return positions, q, k


@pytest.mark.parametrize("name", CASES)
def test_matches_hf_llama(name):
    scaling = CASES[name]
    positions, q, k = _random_qk()
    rope = get_rope(HEAD_DIM, MAX_POS, THETA, scaling)
    q_out, k_out = rope(positions, q, k)
    q_ref, k_ref = _hf_reference(scaling, positions, q, k)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [n for n, s in CASES.items() if s and "factor" in s])
def test_attention_factor_matches_hf_init(name):
    """The cos/sin scale is the attention factor HF's rope init function computes."""
    scaling = CASES[name]
    config = _hf_config(scaling)
    _, hf_attention_factor = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config)
    rope = get_rope(HEAD_DIM, MAX_POS, THETA, scaling)
    norm = torch.hypot(rope.cos_cache, rope.sin_cache)  # cos^2 + sin^2 == attention_factor^2
    torch.testing.assert_close(norm, torch.full_like(norm, hf_attention_factor))


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn", "yarn_mscale_ratio"])
def test_partial_rotary(name):
    """Only the leading dims rotate, exactly as full RoPE with head_dim == rotary_dim would."""
    scaling = CASES[name]
    positions, q, k = _random_qk()
    rope = get_rope(HEAD_DIM, MAX_POS, THETA, scaling, partial_rotary_factor=0.5)
    rot = HEAD_DIM // 2
    q_out, k_out = rope(positions, q, k)
    q_ref, k_ref = get_rope(rot, MAX_POS, THETA, scaling)(positions, q[..., :rot], k[..., :rot])
    torch.testing.assert_close(q_out[..., :rot], q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out[..., :rot], k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(q_out[..., rot:], q[..., rot:])
    assert torch.equal(k_out[..., rot:], k[..., rot:])


def test_partial_rotary_inv_freq_matches_hf():
    """Partial-rotary frequencies equal HF's init functions' output for the rotated dims."""
    for rope_type in ("linear", "llama3", "yarn"):
        scaling = CASES[rope_type]
        config = _hf_config(scaling, partial_rotary_factor=0.25)
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config)
        rope = get_rope(HEAD_DIM, MAX_POS, THETA, scaling, partial_rotary_factor=0.25)
        angles = torch.arange(MAX_POS, dtype=torch.float32)[:, None] * inv_freq[None, :]
        assert rope.rotary_dim == HEAD_DIM // 4
        torch.testing.assert_close(rope.cos_cache, angles.cos() * attention_factor)
        torch.testing.assert_close(rope.sin_cache, angles.sin() * attention_factor)


def test_rope_theta_inside_dict_is_ignored():
    positions, q, k = _random_qk()
    with_theta = get_rope(HEAD_DIM, MAX_POS, THETA, {"rope_type": "default", "rope_theta": 1.0})
    plain = get_rope(HEAD_DIM, MAX_POS, THETA, None)
    for a, b in zip(with_theta(positions, q, k), plain(positions, q, k)):
        assert torch.equal(a, b)


def test_low_precision_dtype_preserved():
    positions, q, k = _random_qk(dtype=torch.bfloat16)
    rope = get_rope(HEAD_DIM, MAX_POS, THETA, CASES["yarn"])
    q_out, k_out = rope(positions, q, k)
    assert q_out.dtype == torch.bfloat16 and k_out.dtype == torch.bfloat16
    assert rope.cos_cache.dtype == torch.float32
    q_ref, k_ref = _hf_reference(CASES["yarn"], positions, q.float(), k.float())
    torch.testing.assert_close(q_out.float(), q_ref, atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(k_out.float(), k_ref, atol=3e-2, rtol=1e-2)


def test_cache_is_non_persistent_buffer():
    rope = get_rope(HEAD_DIM, MAX_POS, THETA, None)
    assert isinstance(rope, RotaryEmbedding)
    assert rope.cos_cache.shape == (MAX_POS, HEAD_DIM // 2)
    assert {name for name, _ in rope.named_buffers()} == {"cos_cache", "sin_cache"}
    assert rope.state_dict() == {}


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "mrope"])
def test_unsupported_type_raises(rope_type):
    with pytest.raises(ValueError, match=rope_type) as info:
        get_rope(HEAD_DIM, MAX_POS, THETA, {"rope_type": rope_type, "factor": 2.0})
    assert all(t in str(info.value) for t in SUPPORTED_ROPE_TYPES)
