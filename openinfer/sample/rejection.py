"""Verify drafted tokens against the target model, exactly (Leviathan et al. 2023; Chen et
al. 2023): the tokens a request gets have the distribution plain decoding gives.

A request verifying k drafts has k + 1 rows of target logits: row j scores the token after
draft j - 1 (row 0: after the last verified token). Every row is processed like a plain
decode row of a request whose output already holds the drafts before it (constraints,
min_tokens, penalties), so each row's distribution p_j is the one plain decoding would
sample from at that point.

- Greedy rows accept draft j while it is row j's argmax, then take the argmax of the
  first row that disagrees (or of row k: the bonus token).
- Random rows accept draft d_j with probability min(1, p_j(d_j) / q_j(d_j)), where q_j is
  the draft distribution (a model drafter's) or a point mass on d_j (n-gram, suffix:
  accepted with probability p_j(d_j)). At the first rejection the token is drawn from the
  residual max(0, p_j - q_j) (for a point mass: p_j without d_j); when all k are accepted
  the bonus is drawn from p_k. The final draw uses the plain sampler's noise for its
  output position, so a request with no drafts samples exactly as without speculation, and
  a seeded request's tokens depend on its own rows only (alone or batched, the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openinfer.outputs import PositionLogprobs
from openinfer.sample.logits_processors import apply_penalties, apply_token_constraints
from openinfer.sample.logprobs import requested_logprobs
from openinfer.sample.rows import SamplingRow
from openinfer.sample.sampler import Sampler, argmax

ACCEPT_STREAM = 1
"""Seeded rows' stream for the acceptance draws (the final token's draw uses stream 0,
as plain sampling does)."""


@dataclass
class VerifyRequest:
    rows: list[SamplingRow]
    """k + 1 rows: row j's output_token_ids end with the first j drafts."""
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None
    """[k, V] draft distributions (model drafters); None: point masses on the drafts."""


@dataclass
class VerifyResult:
    token_ids: list[int]
    """The accepted drafts, then the token drawn at the first rejection (or the bonus)."""
    logprobs: list[PositionLogprobs] | None


def verify(sampler: Sampler, logits: torch.Tensor, requests: list[VerifyRequest], *,
           in_place: bool = False) -> list[VerifyResult]:
    """``logits``: [sum(k_r + 1), V] raw target logits, the requests' rows in order;
    ``in_place``: the caller never reads them again (they may be edited, not copied)."""
    rows = [row for req in requests for row in req.rows]
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"expected logits of shape [{len(rows)}, V], got {tuple(logits.shape)}")
    raw = logits.float()
    # Edits go in place unless the raw logits are read again (logprobs, or the caller).
    keep_raw = not in_place or any(row.params.logprobs is not None for row in rows)
    processed = apply_token_constraints(raw, rows, copy=keep_raw)
    processed = apply_penalties(processed, rows, copy=keep_raw and processed is raw)
    starts = []
    offset = 0
    for req in requests:
        starts.append(offset)
        offset += len(req.rows)

    num_accepted = [0] * len(requests)
    final: list[int | None] = [None] * len(requests)
    greedy = [i for i, req in enumerate(requests) if req.rows[0].params.greedy]
    if greedy:
        index = [starts[i] + j for i in greedy for j in range(len(requests[i].rows))]
        top = argmax(processed[torch.tensor(index, device=raw.device)]).tolist()
        at = 0
        for i in greedy:
            drafts = requests[i].draft_token_ids
            best = top[at:at + len(drafts) + 1]
            a = 0
            while a < len(drafts) and drafts[a] == best[a]:
                a += 1
            num_accepted[i], final[i] = a, best[a]
            at += len(drafts) + 1
    greedy_set = set(greedy)
    randoms = [i for i in range(len(requests)) if i not in greedy_set]
    if randoms:
        _verify_random(sampler, processed, requests, starts, randoms, num_accepted, final)

    token_lists = [req.draft_token_ids[:num_accepted[i]] + [final[i]]
                   for i, req in enumerate(requests)]
    wanted = [i for i, req in enumerate(requests) if req.rows[0].params.logprobs is not None]
    logprobs: dict[int, list[PositionLogprobs]] = {}
    if wanted:
        index = [starts[i] + j for i in wanted for j in range(len(token_lists[i]))]
        tokens = torch.tensor([t for i in wanted for t in token_lists[i]], device=raw.device)
        entries = requested_logprobs(raw[torch.tensor(index, device=raw.device)], tokens,
                                      [rows[r] for r in index])
        at = 0
        for i in wanted:
            logprobs[i] = entries[at:at + len(token_lists[i])]
            at += len(token_lists[i])
    return [VerifyResult(tokens, logprobs.get(i)) for i, tokens in enumerate(token_lists)]


def _verify_random(sampler: Sampler, processed: torch.Tensor, requests: list[VerifyRequest],
                   starts: list[int], chosen: list[int], num_accepted: list[int],
                   final: list[int | None]) -> None:
    device = processed.device
    index = [starts[i] + j for i in chosen for j in range(len(requests[i].rows))]
    sub_rows = [row for i in chosen for row in requests[i].rows]
    probs = sampler.probabilities(processed[torch.tensor(index, device=device)], sub_rows)
    flat = [(i, j) for i in chosen for j in range(len(requests[i].rows))]
    draft_rows = [(at, i, j) for at, (i, j) in enumerate(flat)
                  if j < len(requests[i].draft_token_ids)]
    ratios: dict[tuple[int, int], float] = {}
    if draft_rows:
        at_index = torch.tensor([at for at, _, _ in draft_rows], device=device)
        tokens = torch.tensor([requests[i].draft_token_ids[j] for _, i, j in draft_rows],
                              device=device)
        target = probs[at_index].gather(1, tokens.unsqueeze(1)).squeeze(1)
        proposal = torch.ones_like(target)
        for n, (_, i, j) in enumerate(draft_rows):
            q = requests[i].draft_probs
            if q is not None:
                proposal[n] = q[j, requests[i].draft_token_ids[j]]
        ratio = (target / proposal.clamp_min(torch.finfo(proposal.dtype).tiny)).tolist()
        uniforms = sampler.uniform([requests[i].rows[j] for _, i, j in draft_rows], ACCEPT_STREAM)
        for n, (_, i, j) in enumerate(draft_rows):
            ratios[(i, j)] = ratio[n] - uniforms[n]  # > 0: accepted
    final_rows, final_weights = [], []
    at = 0
    for i in chosen:
        req = requests[i]
        a = 0
        while a < len(req.draft_token_ids) and ratios[(i, a)] > 0:
            a += 1
        num_accepted[i] = a
        weights = probs[at + a]
        if a < len(req.draft_token_ids):  # the residual max(0, p - q)
            weights = weights.clone()
            if req.draft_probs is None:
                weights[req.draft_token_ids[a]] = 0.0
            else:
                weights = (weights - req.draft_probs[a].to(weights)).clamp_min_(0.0)
            if not bool(weights.sum() > 0):  # p == q up to rounding: nothing to correct
                weights = probs[at + a].clone()
        final_rows.append(req.rows[a])
        final_weights.append(weights)
        at += len(req.rows)
    tokens = sampler.race(torch.stack(final_weights), final_rows).tolist()
    for i, token in zip(chosen, tokens):
        final[i] = token
