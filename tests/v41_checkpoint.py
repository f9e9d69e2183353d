"""A tiny DeepSeek-V4.1 checkpoint in DeepInfer's release format (transformers has no V4.1):
what DeepInfer's loader reads (docs/research/deepinfer_v41.md, section 2). config.json with
``text_config``/``vision_config``/``quantization_config``; tensors under the release names;
fp8 e4m3 projections with a power-of-two (e8m0) scale per 32 x 32 tile named
``<module>.scale``; MXFP4 routed experts; bf16 norms and small weights; fp32 mHC and sink
tensors; Engram's n-gram tables as fp8 rows with a scale per 32 of a row; plus tensors the
text model does not read (a DSpark layer, the vision aligner). The layout rules it shares
with the reference (tests/v41_reference.py): the sharing maps' sources, Engram's table
primes and the vocabulary's compression, written from the reading notes, not from the
engine's code.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from pathlib import Path

import torch
from conftest import mxfp4, quantize_blocks
from safetensors.torch import save_file

from openinfer.demo import build_demo_tokenizer

TEXT = dict(
    hidden_act="silu", attention_bias=False, attention_dropout=0.0, num_key_value_heads=1,
    num_hidden_layers=7, num_nextn_predict_layers=1,
    # 0 window; 1 C2 source; 2 C2 reading 1's entries and index keys, choosing its own top-k;
    # C1: 3 the first consumer; 4 reading 3's entries, its own index keys and choice; 5 a
    # source again (from 3's hidden state); 6 reading everything of 5.
    compress_ratios=[0, 2, 2, 1, 1, 1, 1, 0],
    kv_source_layer_ids=[1, 3, 5], index_k_source_layer_ids=[1, 3, 4, 5],
    index_source_layer_ids=[1, 2, 3, 4, 5],
    # 3's indexer also picks 8 blocks of 2 entries per query; 4 and 5 choose within them
    candidate_source_layer_id=3, candidate_topk_blocks=8, candidate_block_size=2,
    hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8,
    q_lora_rank=32, o_lora_rank=16, o_groups=2, vocab_size=1024, max_position_embeddings=2048,
    rms_norm_eps=1e-6, sliding_window=4, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                  "beta_fast": 32, "beta_slow": 1},
    index_topk=4, index_n_heads=2, index_head_dim=16,
    hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, hc_shifted=True,
    moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", norm_topk_prob=True,
    topk_method="noaux_tc", swiglu_limit=1.0, tie_word_embeddings=False,
    dspark_block_size=4, dspark_target_layer_ids=[0, 2], dspark_markov_rank=8,
    dspark_noise_token_id=4, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
    # Engram on a window layer and a C2 layer
    engram_layer_ids=[0, 2], engram_max_ngram_size=3, engram_vocab_size=61, engram_n_heads=2,
    engram_head_dim=32, engram_pad_token_id=2, engram_compressed_vocab_size=900,
)
QUANTIZATION = {"quant_method": "fp8", "expert_dtype": "fp4", "activation_scheme": "dynamic",
                "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}
BLOCK = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_MODULES = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "engram.wkv",
               "attn.indexer.wq_b", "shared_experts.w1", "shared_experts.w2", "shared_experts.w3")


def _fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = t.shape
    groups = t.reshape(n, k // 32, 32)
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-12) / 448)))
    q = (groups / scale[..., None]).reshape(n, k).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _engram_primes(cfg: dict) -> dict[int, list[int]]:
    """Per Engram layer, the table sizes in (n-gram size, head) order: from
    ``engram_vocab_size - 1``, each the next prime above the last, none used twice."""
    seen, out = set(), {}
    for layer in cfg["engram_layer_ids"]:
        sizes = []
        for _ in range(cfg["engram_max_ngram_size"] - 1):
            p = cfg["engram_vocab_size"] - 1
            for _ in range(cfg["engram_n_heads"]):
                p += 1
                while not _is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                sizes.append(p)
        out[layer] = sizes
    return out


def _engram_rows(cfg: dict) -> dict[int, int]:
    return {layer: sum(sizes) for layer, sizes in _engram_primes(cfg).items()}


def _compressed_ids(tokenizer_file: Path) -> list[int]:
    """Each id's compressed id (tokens equal after NFKC, NFD, accents dropped, lowercase,
    whitespace runs as one space and stripped, a lone space kept, share one)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    keys: dict[str, int] = {}
    out = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(i)
        else:
            folded = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
            folded = "".join(c for c in folded if unicodedata.category(c) != "Mn").lower()
            folded = re.sub(r"[ \t\r\n]+", " ", folded)
            key = (folded if folded == " " else folded.strip()) or text
        out.append(keys.setdefault(key, len(keys)))
    return out


def v41_config(**text: object) -> dict:
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
        "dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "image_token_id": 3, "quantization_config": QUANTIZATION,
        "vision_config": {"hidden_size": 64, "downsample_ratio": 2, "patch_size": 14,
                          "max_image_tokens": 256, "min_pixels": 3136, "max_wh_ratio": None},
        "text_config": {**TEXT, **text},
    }


def _layer_tensors(cfg: dict, layer: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    H, D, nh, m = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["hc_mult"]
    rq, G, ro = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    E, inter, S = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["n_shared_experts"]
    hi, di = cfg["index_n_heads"], cfg["index_head_dim"]

    def w(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * inp**-0.5

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.2 * torch.randn(n, generator=g)

    t: dict[str, torch.Tensor] = {"attn_norm.weight": norm(H), "ffn_norm.weight": norm(H)}
    for part in ("attn", "ffn"):
        t[f"hc_{part}_fn"] = torch.randn((2 + m) * m, m * H, generator=g) * 0.05
        t[f"hc_{part}_base"] = torch.randn((2 + m) * m, generator=g) * 0.5
        t[f"hc_{part}_scale"] = torch.rand(3, generator=g) * 1.5 + 0.5
    t |= {"attn.wq_a.weight": w(rq, H), "attn.q_norm.weight": norm(rq),
          "attn.wq_b.weight": w(nh * D, rq), "attn.wkv.weight": w(D, H),
          "attn.kv_norm.weight": norm(D), "attn.wo_a.weight": w(G * ro, nh // G * D),
          "attn.wo_b.weight": w(H, G * ro), "attn.attn_sink": torch.randn(nh, generator=g) * 0.5}
    ratio = cfg["compress_ratios"][layer]
    sources = {key: _source(cfg[key], layer) for key in
               ("kv_source_layer_ids", "index_k_source_layer_ids", "index_source_layer_ids")}
    if ratio and sources["kv_source_layer_ids"] == layer:
        t["attn.compressor.wkv.weight"] = w(D, H)
        if ratio == 2:
            t["attn.compressor.wgate.weight"] = w(D, H) * 4
        t["attn.compressor.norm.weight"] = norm(D)
    if ratio and sources["index_source_layer_ids"] == layer:
        t["attn.indexer.wq_b.weight"] = w(hi * di, rq)
        t["attn.indexer.weights_proj.weight"] = w(hi, H)
    if ratio and sources["index_k_source_layer_ids"] == layer:
        t["attn.indexer.wk.weight"] = w(di, D)
        t["attn.indexer.k_norm.weight"] = norm(di)
    t |= {"ffn.gate.weight": w(E, H), "ffn.gate.bias": torch.randn(E, generator=g) * 0.1,
          "ffn.gate.bias_vl": torch.randn(E, generator=g) * 0.1,
          "ffn.shared_experts.w1.weight": w(S * inter, H),
          "ffn.shared_experts.w3.weight": w(S * inter, H),
          "ffn.shared_experts.w2.weight": w(H, S * inter)}
    for e in range(E):
        t |= {f"ffn.experts.{e}.w1.weight": w(inter, H), f"ffn.experts.{e}.w3.weight": w(inter, H),
              f"ffn.experts.{e}.w2.weight": w(H, inter)}
    return {f"layers.{layer}.{k}": v for k, v in t.items()}


def _source(ids: list[int], layer: int) -> int:
    return max((s for s in ids if s <= layer), default=layer)


def build_v41_checkpoint(path: Path, seed: int = 0, release: bool = True, **text: object) -> Path:
    """A random tiny V4.1 in the release format (see the module docstring), with the demo
    tokenizer; ``text``: ``text_config`` fields to change. ``release=False``: the same
    weights unquantized (float32, no ``quantization_config``)."""
    config = v41_config(**text)
    if not release:
        del config["quantization_config"]
    cfg = config["text_config"]
    g = torch.Generator().manual_seed(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    plain: dict[str, torch.Tensor] = {
        "embed.weight": torch.randn(V, H, generator=g),
        "head.weight": torch.randn(V, H, generator=g) * H**-0.5,
        "norm.weight": 1 + 0.2 * torch.randn(H, generator=g)}
    for layer in range(cfg["num_hidden_layers"]):
        plain |= _layer_tensors(cfg, layer, g)
    rows = _engram_rows(cfg)
    m, d_e = cfg["hc_mult"], cfg["engram_head_dim"]
    width = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"] * d_e
    for layer in cfg["engram_layer_ids"]:
        p = f"layers.{layer}.engram."
        plain |= {p + "embed.weight": torch.randn(rows[layer], d_e, generator=g),
                  p + "wkv.weight": torch.randn((m + 1) * H, width, generator=g) * width**-0.5,
                  p + "q_weight": 1 + 0.2 * torch.randn(m, H, generator=g),
                  p + "k_weight": 1 + 0.2 * torch.randn(m, H, generator=g)}
    # Not read by the text model: a DSpark layer's projection, the vision side.
    plain |= {"mtp.0.main_proj.weight": torch.randn(H, 2 * H, generator=g),
              "mtp.0.main_norm.weight": torch.ones(H), "image_newline": torch.zeros(H),
              "vision_pipeline.aligner.aligner.w1.weight": torch.randn(H, 64, generator=g)}
    stored: dict[str, torch.Tensor] = {}
    for name, t in plain.items():
        module = name.removesuffix(".weight")
        if not release:
            stored[name] = t.float()
        elif ".experts." in name and ".shared_experts." not in name:
            stored[name], stored[f"{module}.scale"] = mxfp4(t)
        elif name.endswith("engram.embed.weight"):  # fp8 rows, a scale per 32 of a row
            stored[name], stored[f"{module}.scale"] = _fp8_rows(t)
        elif name.endswith(".weight") and module.endswith(FP8_MODULES):
            stored[name], stored[f"{module}.scale"] = quantize_blocks(t, BLOCK, ue8m0=True)
        elif name.endswith(("attn_sink", "_fn", "_base", "_scale", "gate.bias", "gate.bias_vl")):
            stored[name] = t.float()
        else:
            stored[name] = t.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    build_demo_tokenizer(V).save_pretrained(path)
    return path
