"""GGUF models: tiny files written here from random-weight checkpoints, and the SmolLM2 file.

Parity is checked against transformers loading the same .gguf (``gguf_file=``), so both
sides dequantize the same bytes, and against the safetensors checkpoint the file came from.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file

import openinfer.config
from openinfer import LLM, SamplingParams
from openinfer.attention import select_attention_backend
from openinfer.config import ModelConfig
from openinfer.kv.spec import FullAttentionSpec, group_layers
from openinfer.model_source import resolve_model
from openinfer.models.loader import load_model
from openinfer.tokenizer import load_tokenizer
from openinfer.transfer.file_store import model_fingerprint
from openinfer.worker.kv_cache import allocate_group_cache, layer_views

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
BLOCK = 4


# ----------------------------------------------------------------------------- writing GGUFs


def llama_rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives q/k of `llama` models: within each head,
    the two rotated halves interleaved (GPT-J pairs) instead of concatenated (NeoX)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp writes for llama3 rope scaling (a divisor per pair)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(ckpt: Path, out: Path, qtype: QT = QT.F32, *, architecture: str | None = None,
               with_tokenizer: bool = True, tensor_types: dict[str, QT] | None = None) -> Path:
    """Convert the checkpoint at ``ckpt`` to ``out`` as llama.cpp's converter would.

    2-D weights are stored as ``qtype`` (norms and biases stay F32, as llama.cpp keeps them);
    ``tensor_types`` overrides the type of single tensors (raw zero bytes for types the gguf
    package cannot quantize to).
    """
    hf = json.loads((ckpt / "config.json").read_text())
    arch = GGUF_ARCH[hf["architectures"][0]]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rope = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta") or rope.get("rope_theta") or 10000.0
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)

    writer = gguf.GGUFWriter(out, architecture or arch)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(hf["vocab_size"])
    file_type = gguf.LlamaFileType.ALL_F32 if qtype == QT.F32 else gguf.LlamaFileType.MOSTLY_Q8_0
    writer.add_file_type(int(file_type))
    if scaling and scaling.get("rope_type") in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling["rope_type"]))
        writer.add_rope_scaling_factor(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    if with_tokenizer:
        _add_tokenizer(writer, ckpt, hf["vocab_size"])

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hf["num_hidden_layers"])
    tensors = load_file(str(ckpt / "model.safetensors"))
    if scaling and scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, theta, scaling))
    for name, tensor in tensors.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        data = tensor.float().numpy()
        if arch == "llama" and ".attn_q." in gguf_name:
            data = llama_rope_permute(data, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            data = llama_rope_permute(data, kv_heads)
        kind = (tensor_types or {}).get(gguf_name, qtype if data.ndim == 2 else QT.F32)
        if kind == QT.F32:
            writer.add_tensor(gguf_name, data)
        elif kind in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.F16, QT.BF16):
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:  # a type we only need the layout of
            block, size = gguf.GGML_QUANT_SIZES[kind]
            raw = np.zeros((data.shape[0], data.shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(gguf_name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer: gguf.GGUFWriter, ckpt: Path, vocab_size: int) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    special = set(tok.all_special_tokens) | {"<|im_start|>", "<|im_end|>", "<|endoftext|>"}
    tokens, types = [], []
    for i in range(vocab_size):  # padded to the model's vocabulary, as llama.cpp pads it
        token = by_id.get(i)
        tokens.append(token if token is not None else f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED if token is None else
                     gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tok.convert_tokens_to_ids("<|endoftext|>"))
    writer.add_eos_token_id(tok.convert_tokens_to_ids("<|im_end|>"))
    writer.add_pad_token_id(tok.convert_tokens_to_ids("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok.chat_template)


# ----------------------------------------------------------------------------- running models


def prefill_logits(model: torch.nn.Module, config: ModelConfig, prompt: list[int]) -> torch.Tensor:
    """Our model's logits for one prompt, computed in one step over a paged cache."""
    spec = FullAttentionSpec(BLOCK, config.num_kv_heads, config.head_dim, "float32")
    (group,) = group_layers([spec] * config.num_layers)
    num_blocks = -(-len(prompt) // BLOCK)
    caches = layer_views(group, allocate_group_cache(group, num_blocks, "cpu"))
    meta = select_attention_backend("auto", "cpu").build_metadata(
        [len(prompt)], [len(prompt)], [list(range(num_blocks))], BLOCK, "cpu")
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), caches,
                       [meta] * len(caches))
        return model.compute_logits(hidden)


def ours(path: Path) -> tuple[ModelConfig, torch.nn.Module]:
    # float32, as transformers: 'auto' computes quantized files in bf16 on CPUs with AVX512_BF16.
    config = ModelConfig.from_pretrained(str(path), dtype="float32")
    return config, load_model(config, progress=False)


def hf_gguf_model(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# transformers reads no head_dim for qwen3 GGUFs (it takes Qwen3Config's default, 128), so the
# Qwen3 files compared with it use head_dim 128; test_gguf_matches_its_source covers others.
ARCH_KWARGS = {
    "LlamaForCausalLM": dict(tie_word_embeddings=False),
    "Qwen2ForCausalLM": dict(tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(tie_word_embeddings=False, head_dim=128),
}


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_logits_match_transformers_on_the_same_file(arch, qtype, make_checkpoint, tmp_path):
    ckpt = make_checkpoint(arch, **ARCH_KWARGS[arch])
    path = write_gguf(ckpt, tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    config, model = ours(path)
    assert (config.format, config.architecture) == ("gguf", arch)
    hf = hf_gguf_model(path)
    for prompt in prompts(config.vocab_size, [7, 19]):
        torch.testing.assert_close(prefill_logits(model, config, prompt), hf_logits(hf, prompt),
                                   atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch,qtype", [("LlamaForCausalLM", QT.Q8_0), ("Qwen3ForCausalLM", QT.F32)],
                         ids=["llama-Q8_0", "qwen3-F32"])
def test_greedy_tokens_match_transformers(arch, qtype, make_checkpoint, tmp_path):
    ckpt = make_checkpoint(arch, **ARCH_KWARGS[arch])
    path = write_gguf(ckpt, tmp_path / "tiny.gguf", qtype)
    llm = LLM(str(path), block_size=BLOCK, progress=False, dtype="float32")
    hf = hf_gguf_model(path)
    batch = prompts(llm.engine.inputs.vocab_size, [3, 17, 30], seed=7)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(prompt):]
        assert out.outputs[0].token_ids == ref.tolist()


@pytest.mark.parametrize("arch,kwargs", [
    ("LlamaForCausalLM", dict(tie_word_embeddings=True)),
    ("Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    # head_dim 32 is neither hidden/heads (16) nor transformers' GGUF default (128).
    ("Qwen3ForCausalLM", dict(head_dim=32)),
    ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64})),
    ("Qwen2ForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    ("Qwen3ForCausalLM", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 128})),
], ids=["llama-tied", "qwen2-untied", "qwen3-head_dim", "llama3-rope", "linear-rope", "yarn-rope"])
def test_gguf_matches_its_source_checkpoint(arch, kwargs, make_checkpoint, hf_model_loader, tmp_path):
    """An F32 GGUF is the checkpoint: same logits as transformers on the safetensors."""
    ckpt = make_checkpoint(arch, **kwargs)
    path = write_gguf(ckpt, tmp_path / "tiny.gguf")
    config, model = ours(path)
    hf = hf_model_loader(ckpt)
    (prompt,) = prompts(config.vocab_size, [150])
    torch.testing.assert_close(prefill_logits(model, config, prompt), hf_logits(hf, prompt),
                               atol=5e-5, rtol=1e-4)


def test_config_comes_from_the_metadata(make_checkpoint, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(openinfer.config, "cpu_flags", lambda: frozenset({"avx2"}))  # no bf16
    ckpt = make_checkpoint("Qwen3ForCausalLM", head_dim=32, max_position_embeddings=384)
    path = write_gguf(ckpt, tmp_path / "Tiny-Qwen3.Q8_0.gguf", QT.Q8_0)
    config = ModelConfig.from_pretrained(str(path))
    hf = json.loads((ckpt / "config.json").read_text())
    assert config.path == str(path)
    assert (config.format, config.served_name) == ("gguf", "Tiny-Qwen3.Q8_0")
    assert config.dtype == torch.float32  # auto on a CPU without native bf16, whatever the file
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (
        hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"])
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 32)
    assert config.max_model_len == 384
    assert config.eos_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert config.hf_config["tie_word_embeddings"] is False


def test_tokenizer_and_chat_template_come_from_the_file(make_checkpoint, tokenizer, tmp_path):
    path = write_gguf(make_checkpoint("Qwen2ForCausalLM"), tmp_path / "tiny.gguf")
    ours_tok = load_tokenizer(str(path))
    for text in ["Hello world, what is the capital of France?", "  indented\n\tcode = f(x) + 1",
                 "héllo wörld 你好 🙂", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert ours_tok.encode(text) == tokenizer.encode(text), text
        assert ours_tok.decode(tokenizer.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert ours_tok.chat_template == tokenizer.chat_template
    assert (ours_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert ours_tok.eos_token == "<|im_end|>"


def test_gguf_fingerprint_reads_the_file(make_checkpoint, tmp_path):
    ckpt = make_checkpoint("Qwen3ForCausalLM")
    a = write_gguf(ckpt, tmp_path / "a.gguf")
    b = write_gguf(ckpt, tmp_path / "b.gguf", QT.Q8_0)
    elsewhere = tmp_path / "elsewhere" / "a.gguf"  # the same bytes under another directory
    elsewhere.parent.mkdir()
    shutil.copyfile(a, elsewhere)
    assert model_fingerprint(elsewhere) == model_fingerprint(a)
    assert model_fingerprint(a) != model_fingerprint(b)
    assert len(model_fingerprint(a)) == 64


# ----------------------------------------------------------------------------- bad files


def _bad_files(ckpt: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    good = write_gguf(ckpt, tmp / "good.gguf")
    data = good.read_bytes()
    files = {}
    for name, content in [("truncated", data[: len(data) // 2]), ("header-only", data[:100]),
                          ("random", np.random.default_rng(0).bytes(4096)), ("empty", b"")]:
        (tmp / f"{name}.gguf").write_bytes(content)
        files[name] = (tmp / f"{name}.gguf", "not a valid GGUF file")
    files["unknown-arch"] = (write_gguf(ckpt, tmp / "unknown-arch.gguf", architecture="mamba"),
                             "architecture 'mamba'.*supported: llama, qwen2, qwen3")
    files["unsupported-type"] = (
        write_gguf(ckpt, tmp / "unsupported-type.gguf",
                   tensor_types={"blk.0.ffn_down.weight": QT.IQ4_NL}),
        "blk.0.ffn_down.weight.*IQ4_NL.*not supported")
    return files


@pytest.fixture
def broken(make_checkpoint, tmp_path):
    return _bad_files(make_checkpoint("LlamaForCausalLM"), tmp_path)


def test_bad_files_are_one_clear_error(broken):
    for kind, (path, problem) in broken.items():
        with pytest.raises(ValueError, match=problem) as info:
            LLM(str(path), progress=False)
        message = str(info.value)
        assert path.name in message, (kind, message)
        assert "\n" not in message, (kind, message)


def test_missing_tokenizer_is_named(make_checkpoint, tmp_path):
    path = write_gguf(make_checkpoint("Qwen3ForCausalLM"), tmp_path / "no-tok.gguf", with_tokenizer=False)
    with pytest.raises(ValueError, match="no-tok.gguf.*tokenizer"):
        LLM(str(path), progress=False)
    llm = LLM(str(path), progress=False, skip_tokenizer_init=True)  # token ids only: fine
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
    assert len(out.outputs[0].token_ids) == 2


def test_cli_reports_a_broken_file_in_one_line(broken, capsys):
    from openinfer.cli import main

    path, _ = broken["truncated"]
    assert main(["generate", "--model", str(path), "--prompt", "x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("openinfer: error:") and "not a valid GGUF file" in err
    assert str(path) in err and "\n" not in err


# ----------------------------------------------------------------------------- SmolLM2


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    start = time.perf_counter()
    # float32: compared with transformers in float32 (auto picks bf16 on CPUs with AVX512_BF16).
    llm = LLM("smollm2", progress=False, max_model_len=1024, kv_cache_memory=64 * 1024**2,
              dtype="float32")
    print(f"LLM('smollm2') built in {time.perf_counter() - start:.1f}s")
    return llm


def test_smollm2_answers_paris(smollm2):
    tok = smollm2.get_tokenizer()
    prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    (out,) = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out.outputs[0].text
    assert smollm2.engine.config.model.served_name == "smollm2-135m-instruct"
    smollm2.engine.check_integrity()


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    path = Path(resolve_model("smollm2").path)
    tok = smollm2.get_tokenizer()
    prompt = tok.encode(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    engine = smollm2.engine.core.executor.worker.runner
    config = smollm2.engine.config.model
    hf = hf_gguf_model(path)
    assert hf.config.tie_word_embeddings and config.hf_config["tie_word_embeddings"]
    expected = hf_logits(hf, prompt)
    got = prefill_logits(engine.model, config, prompt)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert got[-1].argmax() == expected[-1].argmax()

