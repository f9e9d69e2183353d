"""Token embedding and LM head (optionally sharing one weight).

Tensor parallel: both split the vocabulary, padded to a multiple of the ranks; a rank
holds rows ``rank * per_rank ..``. The embedding looks up the ids in its range (zeros for
the rest) and all-reduces; the LM head computes its slice of the logits and all-gathers
them, so every rank samples from the same full logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.distributed.parallel_state import get_tp
from openinfer.layers.linear import GemmLayer, default_weight_loader, narrow, reads_slices


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = get_tp()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp.size)
        self.start = self.tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = (load_vocab_rows if self.tp.size > 1
                                     else default_weight_loader)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


@reads_slices
def load_vocab_rows(param: nn.Parameter, loaded) -> None:
    """This rank's rows of a [vocab, hidden] checkpoint tensor (the padding rows zero)."""
    tp = get_tp()
    vocab = loaded.shape[0] if isinstance(loaded, torch.Tensor) else loaded.get_shape()[0]
    start = tp.rank * param.shape[0]
    rows = max(0, min(param.shape[0], vocab - start))
    param.data.zero_()
    if rows:
        param.data[:rows].copy_(narrow(loaded, 0, start, rows))


class LMHead(GemmLayer):
    """Projects final hidden states to vocabulary logits, in float32 for sampling."""

    # Logits are computed for each sampling sequence's last token only: a step has at most
    # max_num_seqs rows here (32 in a batched decode), and timing a [512, vocab] GEMM would
    # cost more start-up than it could tell.
    timed_buckets = 3

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None) -> None:
        super().__init__()
        self.tp = get_tp()
        self.vocab_size = vocab_size
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            per_rank = -(-vocab_size // self.tp.size)
            self.weight = nn.Parameter(torch.empty(per_rank, hidden_size), requires_grad=False)
            self.weight.weight_loader = (load_vocab_rows if self.tp.size > 1
                                         else default_weight_loader)
        self.register_parameter("bias", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.gemm(hidden).float()
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[:, :self.vocab_size]
