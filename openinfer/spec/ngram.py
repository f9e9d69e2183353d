"""Prompt lookup (n-gram) drafting: find the longest suffix of the context, between
``prompt_lookup_min`` and ``prompt_lookup_max`` tokens, that occurred before, and draft
the tokens that followed its latest occurrence.

All end positions are matched at once with numpy: for each suffix length n the match
mask is the previous mask AND one shifted comparison, so a step costs
O(context * prompt_lookup_max) vectorised work, O(context) for the fixed bound. The
confidence of draft position j is a match statistic: among the occurrences of the matched
n-gram that have a j-th continuation token, the share whose continuation agrees with the
draft up to j (1.0 when the n-gram occurred once)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from openinfer.spec.proposer import Draft, TokenProposer


class NgramProposer(TokenProposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                num_tokens: int) -> Draft:
        return ngram_draft(np.asarray(token_ids, dtype=np.int64), self.min_n, self.max_n,
                           num_tokens)


def ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> Draft:
    length = len(tokens)
    if length < min_n + 1 or num_tokens < 1:
        return Draft()
    # ends[e]: the suffix matched so far ends at e (e < length - 1: something follows it).
    body = tokens[:length - 1]
    matched = body == tokens[-1]
    match_len = matched.astype(np.int32)
    for j in range(1, min(max_n, length - 1)):
        if not matched.any():
            break
        shifted = np.zeros(length - 1, dtype=bool)
        shifted[j:] = body[:length - 1 - j] == tokens[length - 1 - j]
        matched &= shifted
        match_len += matched
    best = int(match_len.max())
    if best < min_n:
        return Draft()
    ends = np.flatnonzero(match_len == best)
    start = int(ends[-1]) + 1  # the latest occurrence
    draft = tokens[start:start + num_tokens]
    # Agreement of every occurrence's continuation with the draft, position by position.
    confidences = []
    agree = np.ones(len(ends), dtype=bool)
    for j, token in enumerate(draft):
        positions = ends + 1 + j
        present = positions < length
        reached = agree & present
        if not reached.any():
            break
        same = np.zeros(len(ends), dtype=bool)
        same[present] = tokens[positions[present]] == token
        now = reached & same
        confidences.append(float(now.sum()) / float(reached.sum()))
        agree = now
    return Draft([int(t) for t in draft[:len(confidences)]], confidences)
