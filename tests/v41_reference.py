"""A plain reference forward for tiny DeepSeek-V4.1 checkpoints (tests/v41_checkpoint.py
builds them; transformers has no V4.1): one sequence in float64 with no cache, every key,
entry and top-k choice recomputed from the whole prefix, written from the reading notes
(docs/research/deepinfer_v41.md, not from the engine's model code), with its own
dequantization of the stored bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from v41_checkpoint import BLOCK, E2M1, _compressed_ids, _engram_primes, _source


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
