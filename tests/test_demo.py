"""The built-in demo model: a random-weight Qwen3 checkpoint that transformers loads as is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from openinfer.demo import (
    DEMO_PRESETS,
    DemoModelSpec,
    build_demo_model,
    build_demo_tokenizer,
    get_demo_spec,
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return {'a': [1, 2.5, None]}  # comment\t\r\n",
    "Emoji 😀👍🏽🇯🇵 and ZWJ 👨‍👩‍👧 sequences",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "mixed: naïve café – “quotes” … \x00\x7f \u200b end",
    "  leading and trailing spaces  ",
    "",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path):
    return AutoTokenizer.from_pretrained(demo_dir)


def test_checkpoint_files(demo_dir: Path) -> None:
    names = {p.name for p in demo_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "README.md"} <= names


def test_readme_says_weights_are_random(demo_dir: Path) -> None:
    readme = (demo_dir / "README.md").read_text()
    assert "THE WEIGHTS ARE RANDOM" in readme
    assert "gibberish" in readme


def test_config(demo_dir: Path, tokenizer) -> None:
    config = AutoConfig.from_pretrained(demo_dir)
    spec = DemoModelSpec()
    assert config.model_type == "qwen3"
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert config.hidden_size == spec.hidden_size
    assert config.num_hidden_layers == spec.num_hidden_layers
    assert config.num_key_value_heads == spec.num_key_value_heads
    assert config.head_dim == spec.head_dim
    assert config.tie_word_embeddings is True
    # Tokenizer size rounded up to a multiple of 64.
    assert config.vocab_size % 64 == 0
    assert len(tokenizer) <= config.vocab_size < len(tokenizer) + 64
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    raw = json.loads((demo_dir / "config.json").read_text())
    assert raw["rope_theta"] == spec.rope_theta


def test_generation_config_eos(demo_dir: Path, tokenizer) -> None:
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    expected = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert generation["eos_token_id"] == expected


def test_model_loads_and_runs(demo_dir: Path, tokenizer) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(demo_dir, output_loading_info=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.float32
    # Norm weights are jittered away from 1 so an engine that skips them is caught.
    q_norm = model.model.layers[0].self_attn.q_norm.weight
    assert not torch.allclose(q_norm, torch.ones_like(q_norm))
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < len(tokenizer) for i in ids)


def test_tokenizer_special_tokens(tokenizer) -> None:
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0, 1, 2]
    assert "<|im_start|>" in tokenizer.all_special_tokens
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # specials are atomic, no BOS is prepended
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi 😀"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 😀<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False)
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n"


def test_tokenizer_is_deterministic() -> None:
    first = build_demo_tokenizer(1024).backend_tokenizer.to_str()
    second = build_demo_tokenizer(1024).backend_tokenizer.to_str()
    assert first == second


def test_padded_vocab_bfloat16(tmp_path: Path) -> None:
    spec = DemoModelSpec(num_hidden_layers=1, vocab_size=4160, dtype="bfloat16",
                         tokenizer_vocab_size=1024)
    path = build_demo_model(tmp_path / "padded", spec)
    config = AutoConfig.from_pretrained(path)
    assert config.vocab_size == 4160
    assert len(AutoTokenizer.from_pretrained(path)) == 1024
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert model.dtype == torch.bfloat16
    assert model.get_input_embeddings().weight.shape == (4160, spec.hidden_size)


def test_same_seed_same_weights(tmp_path: Path) -> None:
    spec = DemoModelSpec(num_hidden_layers=1, tokenizer_vocab_size=512)
    a = build_demo_model(tmp_path / "a", spec)
    b = build_demo_model(tmp_path / "b", spec)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_bench_preset() -> None:
    spec = get_demo_spec("bench-0.3b")
    assert spec is DEMO_PRESETS["bench-0.3b"]
    assert (spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers) == (1024, 3072, 16)
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (16, 8, 64)
    assert spec.vocab_size == 32000 and spec.max_position_embeddings == 4096
    assert spec.tie_word_embeddings is False
    with pytest.raises(ValueError, match="unknown demo preset"):
        get_demo_spec("huge")
