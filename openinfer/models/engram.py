"""Engram (DeepSeek-V4.1): hashed n-gram embeddings gated into the residual streams.

At an Engram layer, before its attention reads the streams, each token t looks up rows for
the n-grams ending at it (n = 2 .. N; tokens of the *compressed* vocabulary, where case,
accents and spacing are folded):

    g_r       = compressed token at t - r (the pad token before the sequence), r = 0 .. N-1
    hash_n    = (g_0 * a_0) xor ... xor (g_{n-1} * a_{n-1})        a: odd per-layer multipliers
    row_{n,j} = hash_n mod p_{n,j} + offset_{n,j}                  one table (prime p) per head j
    e         = [table[row_{n,j}] for n, j]                        [(N - 1) * heads * head_dim]
    k_s, v    = wkv(e) split into hc_mult keys and one value
    stream_s += sigmoid(copysign(sqrt(max(|d|, 1e-6)), d)) * v,
                d = <x_s * q_s, k_s * k_w_s> / (rms(x_s) * rms(k_s) * sqrt(hidden))

The primes, multipliers and the vocabulary compression are DeepInfer's
(``v4_modules/engram_metadata.py``): the checkpoint's tables are indexed by them, so they are
reproduced exactly (numpy's generator seeded per layer, sympy's primes, tokenizers'
normalizers). The gate follows TileKernels' ``engram_gate_ref``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from openinfer.layers.linear import Linear
from openinfer.models.arch import EngramArch

GATE_CLAMP = 1e-6
"""The gate's |d| floor before the square root (DeepInfer's ``clamp_value``)."""


def compressed_vocabulary(tokenizer_file: str) -> list[int]:
    """Each token id's compressed id: tokens whose text, decoded alone, is the same after
    NFKC, NFD, accents stripped, lowercasing and runs of whitespace made one space (a lone
    space kept), then stripped, share one; a piece that is not valid UTF-8 keeps its own
    (its vocabulary spelling). Ids in order of first appearance."""
    from tokenizers import Regex, Tokenizer, normalizers

    tokenizer = Tokenizer.from_file(tokenizer_file)
    sentinel = "\ue000"  # keeps a lone space through Strip
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    ids: dict[str, int] = {}
    table = []
    for token in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token], skip_special_tokens=False)
        key = tokenizer.id_to_token(token) if "\ufffd" in text else normalizer.normalize_str(text) or text
        table.append(ids.setdefault(key, len(ids)))
    return table


def table_primes(arch: EngramArch) -> dict[int, list[list[int]]]:
    """Per Engram layer, per n-gram size, per head: its table's size, the next prime above
    the previous one (from ``table_size - 1`` for each size), no prime used twice."""
    from sympy import nextprime

    seen: set[int] = set()
    primes = {}
    for layer in arch.layer_ids:
        per_size = []
        for _ in range(arch.max_ngram - 1):
            start, sizes = arch.table_size - 1, []
            for _ in range(arch.heads):
                prime = int(nextprime(start))
                while prime in seen:
                    prime = int(nextprime(prime))
                seen.add(prime)
                sizes.append(prime)
                start = prime
            per_size.append(sizes)
        primes[layer] = per_size
    return primes


def multipliers(layer: int, max_ngram: int, vocab: int) -> list[int]:
    """Odd multipliers below int64 max / vocab (so products never overflow), from numpy's
    generator seeded ``10007 * layer``."""
    bound = max(1, (np.iinfo(np.int64).max // vocab) // 2)
    rng = np.random.default_rng(10007 * layer)
    return (rng.integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1).tolist()


class Engram(nn.Module):
    """One layer's tables, projection and gate. ``forward(streams, grams)``: ``grams[t, r]``
    the compressed token at t - r."""

    def __init__(self, arch: EngramArch, layer: int, primes: list[list[int]], vocab: int,
                 hidden: int, streams: int, eps: float) -> None:
        super().__init__()
        self.streams, self.hidden, self.eps = streams, hidden, eps
        sizes = torch.tensor(primes, dtype=torch.long)  # [N - 1, heads]
        flat = sizes.flatten()
        self.register_buffer("primes", sizes, persistent=False)
        self.register_buffer("offsets", torch.cat([flat.new_zeros(1), flat.cumsum(0)[:-1]]),
                             persistent=False)
        self.register_buffer("multipliers", torch.tensor(multipliers(layer, arch.max_ngram, vocab)),
                             persistent=False)
        self.embed = nn.Module()  # the tables, one after another
        tables = [size for sizes in primes for size in sizes]
        self.embed.weight = nn.Parameter(torch.empty(sum(tables), arch.head_dim), requires_grad=False)
        self.wkv = Linear(len(tables) * arch.head_dim, (streams + 1) * hidden)
        self.q_weight = nn.Parameter(torch.empty(streams, hidden), requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(streams, hidden), requires_grad=False)

    def keep_fp8(self) -> None:
        """Before loading: hold the tables as the checkpoint's fp8 rows with a power-of-two
        scale per 32 of a row (a byte per value; a lookup multiplies out only its rows)."""
        rows, dim = self.embed.weight.shape
        self.dense_dtype = self.embed.weight.dtype
        self.embed.weight = nn.Parameter(torch.empty(rows, dim, dtype=torch.float8_e4m3fn),
                                         requires_grad=False)
        self.embed.weight_scale_inv = nn.Parameter(torch.empty(rows, dim // 32), requires_grad=False)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """The tables' ``rows`` [T, n] as [T, n * head_dim] values."""
        table = self.embed.weight
        if table.dtype != torch.float8_e4m3fn:
            return table[rows].flatten(1)
        scale = self.embed.weight_scale_inv[rows].repeat_interleave(32, -1)
        return (table[rows].float() * scale).to(self.dense_dtype).flatten(1)

    def rows(self, grams: torch.Tensor) -> torch.Tensor:
        """Table rows of each token's n-grams: [T, (N - 1) * heads]."""
        products = grams * self.multipliers
        digest, rows = products[:, 0], []
        for n in range(1, products.shape[1]):
            digest = digest ^ products[:, n]
            rows.append(digest[:, None] % self.primes[n - 1])
        return torch.cat(rows, 1) + self.offsets

    def forward(self, h: torch.Tensor, grams: torch.Tensor) -> torch.Tensor:
        T, m, H = h.shape
        kv = self.wkv(self.lookup(self.rows(grams))).view(T, m + 1, H).float()
        key, value = kv[:, :m], kv[:, m]
        x = h.float()
        dot = (x * self.q_weight.float() * self.k_weight.float() * key).sum(-1)
        dot = dot * torch.rsqrt(x.square().mean(-1) + self.eps) \
            * torch.rsqrt(key.square().mean(-1) + self.eps) * H**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=GATE_CLAMP).sqrt(), dot))
        return (x + gate[..., None] * value[:, None]).to(h.dtype)
