"""Model drafters: networks that keep KV of their own in the engine's paged cache (their
layers follow the target's in the runner's layer list, so the KV manager gives them block
tables, prefix caching and tiers like any layer group; when their spec equals the target's
they share its groups).

- ``DraftModelDrafter``: a smaller model with the target's tokenizer. Each step it first
  runs over the step's tokens exactly as the target did (prompt chunks and verified rows
  alike), so its KV follows the target's; then, for every request that sampled, it feeds
  the token just sampled and chains its own picks.
- ``MTPDrafter`` (spec/mtp.py): DeepSeek's multi-token-prediction module, fed the
  target's hidden states.
- ``DSparkDrafter`` (spec/dspark.py): DeepSeek's block drafter, fed the target's layers'
  inputs, with a confidence head.

They draft the same way: greedy requests take the drafter's argmax, the others draw from
its distribution q (the request's temperature, top-k, top-p, min-p), which the verifier
needs (kept per request as ``draft_probs``). The confidence of a draft token is the largest
probability of the distribution it comes from (q, or the drafter's softmax for greedy
requests: the argmax's own), or DSpark's confidence head's estimate, fixed before the token
is drawn. The slots a chain
writes past the sampled token were allocated as lookahead; the next step writes them again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from openinfer.config import ModelConfig
from openinfer.sample.rows import SamplingRow
from openinfer.sample.sampler import Sampler, argmax
from openinfer.spec.context import DraftContext, DraftRequest
from openinfer.spec.proposer import Draft
from openinfer.tokenizer import load_tokenizer

DRAFT_STREAM = 2
"""Seeded rows' noise stream for the drafter's draws (verification uses 0 and 1)."""


@dataclass
class StepBatch:
    """The step the target just ran, as a model drafter needs it."""

    requests: list[DraftRequest]
    """In batch order; their token lists already hold what the step accepted and sampled."""
    query_lens: list[int]
    starts: list[int]
    """Position of each request's first scheduled token."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: list
    """Per layer of the runner's list (target, then drafter)."""
    hidden: torch.Tensor
    """The target's final hidden states, one row per scheduled token."""


def check_draft_model(target: ModelConfig, draft: ModelConfig, tokenizer_path: str | None) -> None:
    """Refuse a draft model the verifier cannot pair with the target: another vocabulary
    size, another tokenizer, or a shorter context."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has "
                         f"{draft.vocab_size} entries, the target's {target.vocab_size}: a draft "
                         "model must share the target's tokenizer and vocabulary")
    if draft.max_model_len < target.max_model_len:
        raise ValueError(f"speculative_config.model: the draft's context ({draft.max_model_len}) "
                         f"is shorter than max_model_len ({target.max_model_len})")
    try:
        target_vocab = load_tokenizer(tokenizer_path or target.path).get_vocab()
        draft_vocab = load_tokenizer(draft.path).get_vocab()
    except (OSError, ValueError):
        return  # token ids only (no tokenizer files): the vocabulary size is all we can check
    if target_vocab != draft_vocab:
        differ = sum(1 for t, i in draft_vocab.items() if target_vocab.get(t) != i)
        raise ValueError(f"speculative_config.model: the draft's tokenizer differs from the "
                         f"target's ({differ} of {len(draft_vocab)} tokens map to other ids)")


class ModelDrafter(ABC):
    def __init__(self, first_layer: int, num_tokens: int) -> None:
        self.first_layer = first_layer
        """Index of the drafter's first layer in the runner's layer list."""
        self.num_tokens = num_tokens

    @abstractmethod
    def propose(self, runner: DraftContext, step: StepBatch, sampled: list[DraftRequest],
                budget: int | None = None) -> dict[str, Draft]:
        """Keep the drafter's KV in step with the target's, and draft for ``sampled``: up to
        k tokens each, and, given a ``budget`` (the draft rows the next step verifies),
        only what may be among them."""

    def _chain_lengths(self, runner: DraftContext, requests: list[DraftRequest],
                       budget: int | None) -> list[int]:
        """Tokens each request's chain may draft: k (at most the budget), within the slots
        allocated (lookahead, capped at the request's max_num_tokens)."""
        groups = self._groups(runner)
        most = self.num_tokens if budget is None else min(self.num_tokens, budget)
        lengths = []
        for req in requests:
            capacity = min(len(req.block_ids[g]) for g in groups) * runner.block_size
            lengths.append(max(0, min(most, capacity - (len(req.token_ids) - 1))))
        return lengths

    def _groups(self, runner: DraftContext) -> list[int]:
        return sorted({runner.layer_group[i] for i in range(self.first_layer, len(runner.layer_group))})

    def _decode_metas(self, runner: DraftContext, requests: list[DraftRequest],
                      positions: list[int]) -> list:
        """Attention metadata of one query token per request at ``positions``, for the
        drafter's layers."""
        by_group = {g: runner.attention.build_metadata(
            query_lens=[1] * len(requests), seq_lens=[p + 1 for p in positions],
            block_tables=[r.block_ids[g] for r in requests], block_size=runner.block_size,
            device=runner.device) for g in self._groups(runner)}
        return [by_group[runner.layer_group[i]]
                for i in range(self.first_layer, len(runner.layer_group))]


def pick_drafts(sampler: Sampler, logits: torch.Tensor, requests: list[DraftRequest],
                drafts: list[Draft], probs: list[list[torch.Tensor]],
                confidences: torch.Tensor | None = None) -> list[int]:
    """Each request's next draft token from the drafter's logits [R, V] (appended to its
    draft with its confidence: ``confidences`` [R] where the drafter estimates them, fixed
    before the draw, else its distribution's largest probability); random requests keep
    their q row in ``probs``."""
    logits = logits.float()
    rows = [SamplingRow(r.params, r.token_ids[:r.num_prompt_tokens],
                        r.token_ids[r.num_prompt_tokens:] + d.token_ids, r.stop_token_ids)
            for r, d in zip(requests, drafts)]
    tokens = argmax(logits)
    estimated = confidences is not None
    if confidences is None:
        confidences = logits.softmax(dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    randoms = [n for n, row in enumerate(rows) if not row.params.greedy]
    if randoms:
        index = torch.tensor(randoms, device=logits.device)
        sub_rows = [rows[n] for n in randoms]
        q = sampler.probabilities(logits[index], sub_rows)
        # The confidence is q's largest probability, known before the draw: one read off
        # the token drawn (its own q) would make whether it is verified depend on its value,
        # and the output distribution would move (with q = (0.9, 0.1) against a target of
        # (0.5, 0.5), the first token was 0 with probability 0.55).
        if not estimated:
            confidences[index] = q.amax(dim=-1)
        tokens[index] = sampler.race(q.clone(), sub_rows, stream=DRAFT_STREAM)
        for n, row_q in zip(randoms, q):
            probs[n].append(row_q)
    token_list = tokens.tolist()
    for draft, token, confidence in zip(drafts, token_list, confidences.tolist()):
        draft.token_ids.append(token)
        draft.confidences.append(confidence)
    return token_list


def finish_drafts(requests: list[DraftRequest], drafts: list[Draft],
                  probs: list[list[torch.Tensor]]) -> dict[str, Draft]:
    for req, q in zip(requests, probs):
        req.draft_probs = torch.stack(q) if q else None
    return {req.request_id: draft for req, draft in zip(requests, drafts)}


class DraftModelDrafter(ModelDrafter):
    def __init__(self, model: nn.Module, first_layer: int, num_tokens: int) -> None:
        super().__init__(first_layer, num_tokens)
        self.model = model

    def propose(self, runner: DraftContext, step: StepBatch, sampled: list[DraftRequest],
                budget: int | None = None) -> dict[str, Draft]:
        caches = runner.layer_caches[self.first_layer:]
        self.model(step.input_ids, step.positions, caches, step.metas[self.first_layer:])
        lengths = self._chain_lengths(runner, sampled, budget)
        drafts = [Draft() for _ in sampled]
        probs: list[list[torch.Tensor]] = [[] for _ in sampled]
        last = [req.token_ids[-1] for req in sampled]
        for j in range(max(lengths, default=0)):
            active = [i for i, n in enumerate(lengths) if n > j]
            reqs = [sampled[i] for i in active]
            positions = [len(r.token_ids) - 1 + j for r in reqs]
            hidden = self.model(runner.long_tensor([last[i] for i in active]), runner.long_tensor(positions),
                                caches, self._decode_metas(runner, reqs, positions))
            picked = pick_drafts(runner.sampler, self.model.compute_logits(hidden), reqs,
                                 [drafts[i] for i in active], [probs[i] for i in active])
            for i, token in zip(active, picked):
                last[i] = token
        return finish_drafts(sampled, drafts, probs)
