"""A mixture-of-experts layer's router: scores every expert for every token and picks the top
k, as the reference models do operation by operation (fp32 logits where they keep them, the
same top-k calls), so ties resolve the same way. openinfer/layers/moe.py runs the experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORING_FUNCS = ("softmax", "sigmoid", "topk_softmax")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    """``softmax`` over all experts, ``sigmoid`` per expert (DeepSeek-V3), or
    or ``topk_softmax``: the top-k logits, softmax over those k (gpt-oss)."""
    method: str = "greedy"
    """``greedy`` (top-k of the scores), ``group_limited_greedy`` (DeepSeek-V2: top-k within
    the ``topk_groups`` groups with the highest best score) or ``noaux_tc`` (DeepSeek-V3:
    groups ranked by their two best bias-corrected scores, experts chosen by the corrected
    scores, weighted by the uncorrected ones)."""
    num_groups: int = 1
    topk_groups: int = 1
    renormalize: bool = False
    """Divide the chosen weights by their sum (``norm_topk_prob``)."""
    scaling: float = 1.0
    """``routed_scaling_factor``, applied to the final weights."""
    fp32_logits: bool = False
    """Router weight and logits in float32 whatever the compute dtype (DeepSeek keeps its
    gate in fp32); otherwise the logits are computed in the compute dtype, as Mixtral and
    Qwen-MoE do, and only the softmax runs in float32."""
    bias: bool = False
    """The router's linear layer has a bias (gpt-oss)."""

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring!r} is not supported; supported: "
                             f"{', '.join(SCORING_FUNCS)}")
        if self.method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.method!r} is not supported; supported: "
                             f"{', '.join(TOPK_METHODS)}")
        if self.method != "greedy" and self.num_experts % self.num_groups:
            raise ValueError(f"n_group {self.num_groups} does not divide n_routed_experts "
                             f"{self.num_experts}")
        if self.scoring == "topk_softmax" and self.method != "greedy":
            raise ValueError("topk_softmax scoring picks experts greedily")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, {self.num_experts}]")


class Router(nn.Module):
    """Scores every expert for every token and picks ``top_k``: (weights fp32 [T, k], ids [T, k])."""

    def __init__(self, hidden_size: int, config: RoutingConfig) -> None:
        super().__init__()
        self.config = config
        dtype = torch.float32 if config.fp32_logits else None
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(config.num_experts, dtype=dtype), requires_grad=False)
                     if config.bias else None)
        if config.method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = F.linear(x.to(self.weight.dtype), self.weight, self.bias)
        if c.scoring == "topk_softmax":  # in the logits' dtype, as gpt-oss does
            values, ids = torch.topk(logits, k=c.top_k, dim=-1)
            return values.softmax(dim=-1).float(), ids
        logits = logits.float()
        scores = logits.softmax(dim=-1) if c.scoring == "softmax" else logits.sigmoid()
        if c.method == "greedy":
            weights, ids = torch.topk(scores, k=c.top_k, dim=-1)
        elif c.method == "group_limited_greedy":
            group_scores = scores.view(-1, c.num_groups, c.num_experts // c.num_groups).amax(dim=-1)
            masked = scores.masked_fill(~self._group_mask(group_scores), 0.0)
            weights, ids = torch.topk(masked, k=c.top_k, dim=-1)
        else:  # noaux_tc
            corrected = scores + self.e_score_correction_bias
            group_scores = (corrected.view(-1, c.num_groups, c.num_experts // c.num_groups)
                            .topk(2, dim=-1)[0].sum(dim=-1))
            corrected = corrected.masked_fill(~self._group_mask(group_scores), float("-inf"))
            ids = torch.topk(corrected, k=c.top_k, dim=-1)[1]
            weights = scores.gather(1, ids)
        if c.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if c.scaling != 1.0:
            weights = weights * c.scaling
        return weights, ids

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, E] True for the experts of each token's ``topk_groups`` best groups."""
        c = self.config
        best = torch.topk(group_scores, k=c.topk_groups, dim=-1)[1]
        groups = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return groups.repeat_interleave(c.num_experts // c.num_groups, dim=1)
