"""Logprobs of the raw model logits: the sampled token with its rank, plus the top N."""

from __future__ import annotations

import torch

from openinfer.outputs import Logprob, PositionLogprobs
from openinfer.sample.rows import SamplingRow

# --------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | list[int], num_top: int
) -> list[PositionLogprobs]:
    """log_softmax of raw logits; for each row a dict containing the given token (with its
    1-based rank) plus the num_top most likely tokens (ranks 1..num_top)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return _logprob_dicts(logprobs, token_ids, [num_top] * logits.shape[0])


def requested_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]
) -> list[PositionLogprobs | None]:
    """Logprob dicts for the rows that asked for them (None elsewhere), from the raw logits."""
    result: list[PositionLogprobs | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return result
    if len(wanted) == len(rows):
        sub_logits, sub_tokens = raw_logits, token_ids
    else:
        index = torch.tensor(wanted, device=raw_logits.device)
        sub_logits, sub_tokens = raw_logits[index], token_ids[index]
    logprobs = torch.log_softmax(sub_logits, dim=-1)
    num_tops = [rows[i].params.logprobs for i in wanted]
    for i, entry in zip(wanted, _logprob_dicts(logprobs, sub_tokens, num_tops)):
        result[i] = entry
    return result


def _logprob_dicts(
    logprobs: torch.Tensor, token_ids: torch.Tensor | list[int], num_tops: list[int]
) -> list[PositionLogprobs]:
    """One dict per row: the given token plus that row's num_tops[i] most likely tokens."""
    num_rows, vocab_size = logprobs.shape
    tokens = torch.as_tensor(token_ids, dtype=torch.long, device=logprobs.device).view(num_rows, 1)
    token_logprob = logprobs.gather(1, tokens)
    # 1 + the number of strictly more likely tokens.
    token_rank = (logprobs > token_logprob).sum(dim=-1) + 1
    max_top = min(max(num_tops, default=0), vocab_size)
    top = logprobs.topk(max_top, dim=-1)

    # One transfer per tensor, not one per element.
    tokens_l = tokens.squeeze(1).tolist()
    token_logprob_l = token_logprob.squeeze(1).tolist()
    token_rank_l = token_rank.tolist()
    top_ids_l = top.indices.tolist()
    top_logprobs_l = top.values.tolist()

    result: list[PositionLogprobs] = []
    for r in range(num_rows):
        n = min(num_tops[r], vocab_size)
        entry: PositionLogprobs = {
            token: Logprob(logprob=logprob, rank=rank)
            for rank, (token, logprob) in enumerate(
                zip(top_ids_l[r][:n], top_logprobs_l[r][:n]), start=1
            )
        }
        token = tokens_l[r]
        if token not in entry:
            # Under ties the count of strictly better tokens can be <= n even though topk
            # listed n others first; rank it after them so ranks in a dict stay distinct.
            rank = max(token_rank_l[r], n + 1)
            entry[token] = Logprob(logprob=token_logprob_l[r], rank=rank)
        result.append(entry)
    return result
