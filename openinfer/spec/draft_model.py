"""A draft model: a smaller model with the target's tokenizer, run by the model runner
beside the target with its layers' KV in the same paged cache (its layers follow the
target's in the layer list, so the KV manager gives them block tables, prefix caching and
tiers like any layer group; when their spec equals the target's they share its groups).

Each step the draft model first runs over the step's tokens exactly as the target does
(prompt chunks and verified rows alike), so its KV follows the target's. Then, for every
request that sampled, it drafts k tokens by feeding the token just sampled and chaining
its own picks: greedy requests take its argmax, the others draw from its distribution q
(the request's temperature, top-k, top-p, min-p), which the verifier needs (kept per
request as ``draft_probs``). The confidence of a draft token is its probability under q
(under the draft's softmax for greedy requests). The slots the chain writes past the
sampled token were allocated as lookahead; the next step's first pass writes them again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from openinfer.config import ModelConfig
from openinfer.layers.sampler import SamplingRow
from openinfer.spec.proposer import Draft

if TYPE_CHECKING:
    from openinfer.engine.runner import ModelRunner, RunnerRequest

DRAFT_STREAM = 2
"""Seeded rows' noise stream for the drafter's draws (verification uses 0 and 1)."""


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
    from openinfer.engine.input_processor import load_tokenizer

    try:
        target_vocab = load_tokenizer(tokenizer_path or target.path).get_vocab()
        draft_vocab = load_tokenizer(draft.path).get_vocab()
    except (OSError, ValueError):
        return  # token ids only (no tokenizer files): the vocabulary size is all we can check
    if target_vocab != draft_vocab:
        differ = sum(1 for t, i in draft_vocab.items() if target_vocab.get(t) != i)
        raise ValueError(f"speculative_config.model: the draft's tokenizer differs from the "
                         f"target's ({differ} of {len(draft_vocab)} tokens map to other ids)")


class ModelDrafter:
    def __init__(self, model: nn.Module, first_layer: int, num_tokens: int) -> None:
        self.model = model
        self.first_layer = first_layer
        """Index of the draft's first layer in the runner's layer list."""
        self.num_tokens = num_tokens

    def run_step(self, runner: ModelRunner, input_ids: torch.Tensor, positions: torch.Tensor,
                 metas: list) -> None:
        """The first pass: the step's tokens through the draft, for their KV."""
        self.model(input_ids, positions, runner.layer_caches[self.first_layer:],
                   metas[self.first_layer:])

    def propose(self, runner: ModelRunner, requests: list[RunnerRequest]) -> dict[str, Draft]:
        if not requests:
            return {}
        sampler, block_size = runner.sampler, runner.block_size
        layers = range(self.first_layer, len(runner.layer_group))
        groups = sorted({runner.layer_group[i] for i in layers})
        # The chain stays inside the slots allocated (lookahead, capped at max_num_tokens).
        lengths = []
        for req in requests:
            capacity = min(len(req.block_ids[g]) for g in groups) * block_size
            lengths.append(max(0, min(self.num_tokens, capacity - (len(req.token_ids) - 1))))
        drafts = [Draft() for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        last = [req.token_ids[-1] for req in requests]
        for j in range(max(lengths)):
            active = [i for i, n in enumerate(lengths) if n > j]
            reqs = [requests[i] for i in active]
            positions = [len(r.token_ids) - 1 + j for r in reqs]
            by_group = {g: runner.attention.build_metadata(
                query_lens=[1] * len(reqs), seq_lens=[p + 1 for p in positions],
                block_tables=[r.block_ids[g] for r in reqs], block_size=block_size,
                device=runner.device) for g in groups}
            metas = [by_group[runner.layer_group[i]] for i in layers]
            hidden = self.model(runner._long([last[i] for i in active]), runner._long(positions),
                                runner.layer_caches[self.first_layer:], metas)
            logits = self.model.compute_logits(hidden).float()
            rows = [SamplingRow(r.params, r.token_ids[:r.num_prompt_tokens],
                                r.token_ids[r.num_prompt_tokens:] + drafts[i].token_ids,
                                r.stop_token_ids) for i, r in zip(active, reqs)]
            tokens, confidences = self._pick(sampler, logits, rows, active, probs)
            for i, token, confidence in zip(active, tokens, confidences):
                drafts[i].token_ids.append(token)
                drafts[i].confidences.append(confidence)
                last[i] = token
        result = {}
        for req, draft, q in zip(requests, drafts, probs):
            req.draft_probs = torch.stack(q) if q else None
            result[req.request_id] = draft
        return result

    @staticmethod
    def _pick(sampler, logits: torch.Tensor, rows: list[SamplingRow], active: list[int],
              probs: list[list[torch.Tensor]]) -> tuple[list[int], list[float]]:
        """Each row's draft token and its confidence; random rows keep their q."""
        tokens = logits.argmax(dim=-1)
        confidences = logits.softmax(dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        randoms = [n for n, row in enumerate(rows) if not row.params.greedy]
        if randoms:
            index = torch.tensor(randoms, device=logits.device)
            sub_rows = [rows[n] for n in randoms]
            q = sampler.probabilities(logits[index], sub_rows)
            picked = sampler.race(q.clone(), sub_rows, stream=DRAFT_STREAM)
            tokens[index] = picked
            confidences[index] = q.gather(1, picked.unsqueeze(1)).squeeze(1)
            for n, row_q in zip(randoms, q):
                probs[active[n]].append(row_q)
        return tokens.tolist(), confidences.tolist()
