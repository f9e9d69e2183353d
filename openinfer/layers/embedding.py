"""Token embedding and LM head (optionally sharing one weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.layers.linear import GemmLayer, default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class LMHead(GemmLayer):
    """Projects final hidden states to vocabulary logits, in float32 for sampling."""

    # Logits are computed for each sampling sequence's last token only: a step has at most
    # max_num_seqs rows here (32 in a batched decode), and timing a [512, vocab] GEMM would
    # cost more start-up than it could tell.
    timed_buckets = 3

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None) -> None:
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
            self.weight.weight_loader = default_weight_loader
        self.register_parameter("bias", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gemm(hidden).float()
