"""DeepSeek-V4.1's sparse attention parts (openinfer/models/deepseek_v41.py): the
compressor that makes a KV source's entries, the indexer that scores them, and the top-k
choice, within candidate blocks after the candidate source."""

from __future__ import annotations

import torch
from torch import nn

from openinfer.layers.linear import Linear
from openinfer.layers.norm import RMSNorm
from openinfer.models.arch import ArchConfig, CandidateArch, V41Arch


class V41Compressor(nn.Module):
    """A KV source's entries from its hidden rows: C1 one per token (``wkv``); C2 one per
    pair, each channel a softmax-of-``wgate``-weighted sum (float32) of the pair's ``wkv``."""

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(hidden, dim)
        if ratio == 2:
            self.wgate = Linear(hidden, dim)
        self.norm = RMSNorm(dim, eps, fp32_weight=True)

    @staticmethod
    def pool_pairs(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """[2c, dim] rows of c complete pairs -> [c, dim]."""
        c = kv.shape[0] // 2
        weights = gate.view(c, 2, -1).float().softmax(1)
        return (kv.view(c, 2, -1).float() * weights).sum(1).to(kv.dtype)


class V41Indexer(nn.Module):
    """Per query ``index_n_heads`` scores ``relu(q_h . k_j)`` weighted by ``weights_proj``;
    an index-K source also makes the keys: ``k_norm(wk(entry before RoPE))``, roped."""

    def __init__(self, arch: ArchConfig, v41: V41Arch, makes_keys: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk = v41.index_heads, v41.index_head_dim, v41.index_topk
        self.wq_b = Linear(v41.q_lora_rank, self.num_heads * self.head_dim)
        self.weights_proj = Linear(arch.hidden_size, self.num_heads)
        if makes_keys:
            self.wk = Linear(arch.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, fp32_weight=True)


def top_k_entries(score: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """[n, L] bool: each row's ``k`` highest-scoring allowed entries (all, if fewer). Ties
    (ReLU zeros) go to the earlier entry (a stable sort): the choice never depends on how
    many entries a step scores (its chunking, a prefix hit)."""
    score = score.masked_fill(~allowed, float("-inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :min(k, score.shape[1])]
    return torch.zeros_like(allowed).scatter_(1, order, True) & allowed


def candidate_block_scores(score: torch.Tensor, visible: torch.Tensor,
                           block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(best [n, blocks], valid [n]): each block's highest score over its visible entries,
    rounded to bf16 and capped at bf16's largest finite value, the last block holding a
    visible entry set to +inf; and how many blocks hold one (DeepInfer's block maximum)."""
    n, length = score.shape
    blocks = -(-length // block_size)
    padded = score.new_full((n, blocks * block_size), float("-inf"))
    padded[:, :length] = score.masked_fill(~visible, float("-inf")).to(torch.bfloat16).float()
    best = padded.view(n, blocks, block_size).amax(-1).clamp(max=torch.finfo(torch.bfloat16).max)
    valid = -(-visible.sum(1) // block_size)
    last = (valid - 1).clamp(min=0)[:, None]
    best.scatter_(1, last, torch.where(valid[:, None] > 0, float("inf"), best.gather(1, last)))
    return best, valid


def candidate_entries(score: torch.Tensor, visible: torch.Tensor, c: CandidateArch) -> torch.Tensor:
    """[n, L] bool: the entries of each query's ``topk_blocks`` best blocks."""
    best, valid = candidate_block_scores(score, visible, c.block_size)
    in_range = torch.arange(best.shape[1], device=score.device)[None, :] < valid[:, None]
    chosen = top_k_entries(best, in_range, c.topk_blocks)
    return chosen.repeat_interleave(c.block_size, 1)[:, :score.shape[1]]
