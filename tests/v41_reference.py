"""A tiny DeepSeek-V4.1 checkpoint in DeepInfer's release format, and a plain reference
forward for it (transformers has no V4.1).

The builder writes what DeepInfer's loader reads (docs/research/deepinfer_v41.md, section 2):
config.json with ``text_config``/``vision_config``/``quantization_config``, tensors under the
release names, fp8 e4m3 projections with a power-of-two (e8m0) scale per 32 x 32 tile named
``<module>.scale``, MXFP4 routed experts, bf16 norms and small weights, fp32 mHC and sink
tensors, Engram's n-gram tables as fp8 rows with a scale per 32 of a row; plus tensors the
text model does not read (a DSpark layer, the vision aligner).

The reference runs one sequence in float64 with no cache: every key, entry and top-k choice
recomputed from the whole prefix, written from the reading notes (not from the engine's
model code), with its own dequantization of the stored bytes.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from conftest import mxfp4, quantize_blocks
from safetensors.torch import load_file, save_file

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


# ---- the checkpoint --------------------------------------------------------------------------

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


# ---- the reference ---------------------------------------------------------------------------

def _dequantize(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """float64 values of every tensor: fp8 x 2^(e - 127) per 32 x 32 tile; MXFP4 nibbles
    (low first) x 2^(e - 127) per 32 inputs of a row."""
    out = {}
    for name, t in stored.items():
        if name.endswith(".scale"):
            continue
        scale_name = name.removesuffix(".weight") + ".scale"
        if scale_name not in stored:
            out[name] = t.double()
            continue
        exponent = stored[scale_name].view(torch.uint8).long() - 127
        factor = torch.pow(2.0, exponent.double())
        if t.dtype == torch.int8:
            b = t.view(torch.uint8).long()
            codes = torch.stack([b & 15, b >> 4], -1).flatten(-2)
            value = torch.tensor(E2M1, dtype=torch.float64)[codes & 7] * (1 - 2 * (codes >> 3))
            out[name] = value * factor.repeat_interleave(32, 1)
        else:
            n, k = t.shape
            rows = 1 if factor.shape[0] == n and n > BLOCK else BLOCK  # per-row: Engram tables
            tiles = factor.repeat_interleave(rows, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
            out[name] = t.double() * tiles
    return out


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def _inv_freq(d: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """RoPE frequencies; YaRN's blend of interpolated and extrapolated ones (DeepInfer's
    YaRNScalingRotaryEmbedding, magnitude factor 1)."""
    freqs = theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if not yarn:
        return 1 / freqs
    orig, factor = yarn["original_max_position_embeddings"], yarn["factor"]

    def dim_of(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(yarn["beta_fast"])), 0)
    high = min(math.ceil(dim_of(yarn["beta_slow"])), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies kept), 0: interpolate
    return (1 / (factor * freqs)) * (1 - keep) + (1 / freqs) * keep


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
          inverse: bool = False) -> torch.Tensor:
    """Interleaved pairs of the last 2 * len(inv_freq) dims rotated by position x frequency."""
    d = 2 * inv_freq.shape[0]
    angle = positions.double()[:, None] * inv_freq[None, :]
    if inverse:
        angle = -angle
    shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    a, b = x[..., -d:][..., 0::2], x[..., -d:][..., 1::2]
    rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    return torch.cat([x[..., :-d], rotated], -1)


def _mixes(R: torch.Tensor, fn, base, scale, m: int, iters: int, eps: float, norm_eps: float):
    flat = _rms(R.flatten(1), None, norm_eps)
    mix = flat @ fn.T
    pre = torch.sigmoid(mix[:, :m] * scale[0] + base[:m]) + eps
    post = 2 * torch.sigmoid(mix[:, m:2 * m] * scale[1] + base[m:2 * m])
    comb = torch.softmax(mix[:, 2 * m:].view(-1, m, m) * scale[2] + base[2 * m:].view(m, m), -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


class V41Reference:
    """``logits(ids)``: [T, vocab] float64 for one sequence."""

    def __init__(self, path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        self.cfg = c = config["text_config"]
        self.w = _dequantize(load_file(path / "model.safetensors"))
        self.n = c["num_hidden_layers"]
        self.ratios = c["compress_ratios"][:self.n]
        self.first_consumer = self.ratios.index(1)
        self.kv_src = [_source(c["kv_source_layer_ids"], i) for i in range(self.n)]
        self.ik_src = [_source(c.get("index_k_source_layer_ids") or c["kv_source_layer_ids"], i)
                       for i in range(self.n)]
        self.ix_src = [_source(c["index_source_layer_ids"], i) for i in range(self.n)]
        if c.get("engram_layer_ids"):
            self.compressed = _compressed_ids(path / "tokenizer.json")
            vocab = max(self.compressed) + 1
            bound = (np.iinfo(np.int64).max // vocab) // 2
            self.mult = {layer: [int(a) * 2 + 1 for a in np.random.default_rng(10007 * layer).integers(
                0, bound, size=(c["engram_max_ngram_size"],), dtype=np.int64)]
                for layer in c["engram_layer_ids"]}
            self.primes = _engram_primes(c)
        d_r = c["qk_rope_head_dim"]
        yarn = c.get("rope_scaling")
        self.freq_window = _inv_freq(d_r, c["rope_theta"], None)
        self.freq_compressed = _inv_freq(d_r, c["compress_rope_theta"], yarn)

    def logits(self, ids: list[int]) -> torch.Tensor:
        c, w, eps = self.cfg, self.w, self.cfg["rms_norm_eps"]
        m = c["hc_mult"]
        T = len(ids)
        pos = torch.arange(T)
        R = w["embed.weight"][torch.tensor(ids)][:, None, :].repeat(1, m, 1)
        pre = None
        self.state: dict[int, dict] = {}
        self.candidates: dict[int, set[int]] = {}
        self.shared = None
        for layer in range(self.n):
            p = f"layers.{layer}."
            if layer in c.get("engram_layer_ids", []):
                R = self._engram(layer, R, ids)
            mix_a, post, comb = self._hc(R, p + "hc_attn")
            x = R[:, 0] if pre is None else (pre[..., None] * R).sum(1)
            xn = _rms(x, w[p + "attn_norm.weight"], eps)
            if layer == self.first_consumer:
                self.shared = xn
            y = self._attention(layer, xn, pos)
            R = post[..., None] * y[:, None] + torch.einsum("tjk,tjh->tkh", comb, R)
            mix_f, post, comb = self._hc(R, p + "hc_ffn")
            x = (mix_a[..., None] * R).sum(1)
            y = self._moe(layer, _rms(x, w[p + "ffn_norm.weight"], eps))
            R = post[..., None] * y[:, None] + torch.einsum("tjk,tjh->tkh", comb, R)
            pre = mix_f
        h = _rms((pre[..., None] * R).sum(1), w["norm.weight"], eps)
        return h @ w["head.weight"].T

    def _engram(self, layer: int, R: torch.Tensor, ids: list[int]) -> torch.Tensor:
        c, w = self.cfg, self.w
        p = f"layers.{layer}.engram."
        N, heads = c["engram_max_ngram_size"], c["engram_n_heads"]
        pad = self.compressed[c["engram_pad_token_id"]]
        table, rows = w[p + "embed.weight"], []
        for t in range(len(ids)):
            grams = [self.compressed[ids[t - r]] if t >= r else pad for r in range(N)]
            row, offset, digest = [], 0, grams[0] * self.mult[layer][0]
            for n in range(1, N):
                digest ^= grams[n] * self.mult[layer][n]
                for j in range(heads):
                    prime = self.primes[layer][(n - 1) * heads + j]
                    row.append(table[offset + digest % prime])
                    offset += prime
            rows.append(torch.cat(row))
        T, m, H = R.shape
        kv = (torch.stack(rows) @ w[p + "wkv.weight"].T).view(T, m + 1, H)
        key, value = kv[:, :m], kv[:, m]
        eps = c["rms_norm_eps"]
        d = (R * w[p + "q_weight"] * key * w[p + "k_weight"]).sum(-1) / H**0.5
        d = d / torch.sqrt(R.square().mean(-1) + eps) / torch.sqrt(key.square().mean(-1) + eps)
        gate = torch.sigmoid(torch.sign(d) * torch.sqrt(d.abs().clamp(min=1e-6)))
        return R + gate[..., None] * value[:, None]

    def _hc(self, R: torch.Tensor, prefix: str):
        c, w = self.cfg, self.w
        return _mixes(R, w[prefix + "_fn"], w[prefix + "_base"], w[prefix + "_scale"], c["hc_mult"],
                      c["hc_sinkhorn_iters"], c["hc_eps"], c["rms_norm_eps"])

    def _attention(self, layer: int, xn: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c, w, eps = self.cfg, self.w, self.cfg["rms_norm_eps"]
        p = f"layers.{layer}.attn."
        T, H, D, W = xn.shape[0], c["num_attention_heads"], c["head_dim"], c["sliding_window"]
        ratio = self.ratios[layer]
        freq = self.freq_compressed if ratio else self.freq_window
        qa = _rms(xn @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"], eps)
        q = _rope((qa @ w[p + "wq_b.weight"].T).view(T, H, D), pos, freq)
        kv = _rope(_rms(xn @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"], eps), pos, freq)
        state: dict = {}
        if ratio:
            state = self._entries(layer, xn, ratio, freq)
            self.state[layer] = state
        out = torch.zeros(T, H, D, dtype=torch.float64)
        sink = w[p + "attn_sink"]
        for t in range(T):
            keys = [kv[max(0, t - W + 1):t + 1]]
            if ratio and (t + 1) // ratio:
                keys.append(state["entries"][state["choice"][t]])
            k = torch.cat(keys, 0)
            logits = torch.einsum("hd,ld->hl", q[t], k) * D**-0.5
            probs = torch.cat([logits, sink[:, None]], 1).softmax(-1)[:, :-1]
            out[t] = probs @ k
        out = _rope(out, pos, freq, inverse=True)
        G = c["o_groups"]
        wa = w[p + "wo_a.weight"].view(G, c["o_lora_rank"], -1)
        o = torch.einsum("tgi,gri->tgr", out.reshape(T, G, -1), wa).flatten(1)
        return o @ w[p + "wo_b.weight"].T

    def _entries(self, layer: int, xn: torch.Tensor, ratio: int, freq: torch.Tensor) -> dict:
        """The layer's entries (roped), index keys and every query's top-k choice."""
        c, w, eps = self.cfg, self.w, self.cfg["rms_norm_eps"]
        p = f"layers.{layer}.attn."
        T = xn.shape[0]
        if self.kv_src[layer] == layer:
            h = self.shared if layer >= self.first_consumer else xn
            lat = h @ w[p + "compressor.wkv.weight"].T
            if ratio == 2:
                count = T // 2
                score = (h @ w[p + "compressor.wgate.weight"].T)[:2 * count].view(count, 2, -1)
                c_pre = (lat[:2 * count].view(count, 2, -1) * score.softmax(1)).sum(1)
            else:
                c_pre = lat
            pre_rope = _rms(c_pre, w[p + "compressor.norm.weight"], eps)
            at = torch.arange(pre_rope.shape[0]) * ratio
            entries = _rope(pre_rope, at, freq)
        else:
            source = self.state[self.kv_src[layer]]
            pre_rope, entries = source["pre_rope"], source["entries"]
        count = entries.shape[0]
        at = torch.arange(count) * ratio
        if self.ik_src[layer] == layer:
            index_keys = _rope(_rms(pre_rope @ w[p + "indexer.wk.weight"].T,
                                    w[p + "indexer.k_norm.weight"], eps), at, freq)
        else:
            index_keys = self.state[self.ik_src[layer]]["index_keys"]
        if self.ix_src[layer] == layer:
            hi, di, k = c["index_n_heads"], c["index_head_dim"], c["index_topk"]
            qa = _rms(xn @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"], eps)
            qi = _rope((qa @ w[p + "indexer.wq_b.weight"].T).view(T, hi, di), torch.arange(T), freq)
            weights = xn @ w[p + "indexer.weights_proj.weight"].T
            source = c.get("candidate_source_layer_id")
            choice = []
            for t in range(T):
                visible = (t + 1) // ratio
                score = (weights[t][:, None] * F.relu(qi[t] @ index_keys[:visible].T)).sum(0)
                pool = range(visible)
                if layer == source:
                    self.candidates[t] = self._candidate_blocks(score)
                elif source is not None and layer > source:
                    pool = [j for j in pool if j // c["candidate_block_size"] in self.candidates[t]]
                # ties to the earlier entry
                order = sorted(pool, key=lambda j: (-float(score[j]), j))
                choice.append(torch.tensor(sorted(order[:k]), dtype=torch.long))
        else:
            choice = self.state[self.ix_src[layer]]["choice"]
        return {"pre_rope": pre_rope, "entries": entries, "index_keys": index_keys, "choice": choice}

    def _candidate_blocks(self, score: torch.Tensor) -> set[int]:
        """The blocks whose best score, rounded to bf16 (capped at its largest finite value),
        is among the ``candidate_topk_blocks`` highest; the last block always."""
        size, count = self.cfg["candidate_block_size"], self.cfg["candidate_topk_blocks"]
        rounded = score.to(torch.bfloat16).double().tolist()
        blocks = [rounded[i:i + size] for i in range(0, len(rounded), size)]
        best = [min(max(b), float(torch.finfo(torch.bfloat16).max)) for b in blocks]
        if best:
            best[-1] = math.inf
        return set(sorted(range(len(best)), key=lambda i: (-best[i], i))[:count])

    def _moe(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        c, w = self.cfg, self.w
        p = f"layers.{layer}.ffn."
        L = c["swiglu_limit"]

        def mlp(x, w1, w3, w2):
            return (F.silu((x @ w1.T).clamp(max=L)) * (x @ w3.T).clamp(-L, L)) @ w2.T

        s = torch.sqrt(F.softplus(x @ w[p + "gate.weight"].T))
        top = torch.topk(s + w[p + "gate.bias"], c["num_experts_per_tok"], -1).indices
        weights = s.gather(1, top)
        weights = weights / weights.sum(-1, keepdim=True) * c["routed_scaling_factor"]
        y = mlp(x, w[p + "shared_experts.w1.weight"], w[p + "shared_experts.w3.weight"],
                w[p + "shared_experts.w2.weight"])
        for t in range(x.shape[0]):
            for e, weight in zip(top[t].tolist(), weights[t], strict=True):
                e_ = f"{p}experts.{e}."
                y[t] += weight * mlp(x[t:t + 1], w[e_ + "w1.weight"], w[e_ + "w3.weight"],
                                     w[e_ + "w2.weight"])[0]
        return y
