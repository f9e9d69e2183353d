"""Verification is exact: the accepted-token distribution is the target's (the model is
vLLM's test_rejection_sampling_approximates_target_distribution), for model drafts (full
draft distributions) and n-gram/suffix drafts (point masses), under top-k/top-p/penalties."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from openinfer.sample.rejection import VerifyRequest, verify
from openinfer.sample.rows import SamplingRow
from openinfer.sample.sampler import Sampler
from openinfer.sampling_params import SamplingParams

VOCAB = 8
TRIALS = 12000


def _rows(params: SamplingParams, drafts: list[int], output: list[int] | None = None):
    output = output or []
    return [SamplingRow(params, [1, 2, 3], output + drafts[:j], frozenset())
            for j in range(len(drafts) + 1)]


def _target_probs(sampler: Sampler, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What plain sampling draws from, row by row."""
    rows = [SamplingRow(params, [1, 2, 3], [], frozenset())] * logits.shape[0]
    return sampler.probabilities(logits, rows)


def _first_tokens(logits_per_position: torch.Tensor, params: SamplingParams,
                  draft_probs: torch.Tensor | None, fixed_drafts: list[int] | None,
                  seed: int) -> tuple[list[int], list[list[int]]]:
    """TRIALS verifications of k drafts; returns the first output token of each and the
    whole accepted runs."""
    torch.manual_seed(seed)
    k = logits_per_position.shape[0] - 1
    requests = []
    for _ in range(TRIALS):
        if fixed_drafts is not None:
            drafts = list(fixed_drafts)
        else:
            drafts = [int(torch.multinomial(draft_probs[j], 1)) for j in range(k)]
        requests.append(VerifyRequest(_rows(params, drafts), drafts, draft_probs))
    logits = logits_per_position.repeat(TRIALS, 1)
    results = verify(Sampler(seed), logits, requests)
    return [r.token_ids[0] for r in results], [r.token_ids for r in results]


def _counts(tokens: list[int]) -> list[int]:
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).tolist()


def _fits(tokens: list[int], probs: torch.Tensor) -> bool:
    """Chi-square goodness of fit at the 0.1% level (tokens of zero probability must not
    appear at all)."""
    counts = _counts(tokens)
    support = probs > 0
    if any(c and not s for c, s in zip(counts, support.tolist())):
        return False
    observed = [c for c, s in zip(counts, support.tolist()) if s]
    share = probs[support].double()
    expected = (share / share.sum() * sum(observed)).tolist()
    return chisquare(observed, expected).pvalue > 1e-3


def _logits(seed: int, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator) * 1.5


def test_model_drafts_keep_the_target_distribution_at_every_position():
    params = SamplingParams(temperature=0.9, max_tokens=100)
    logits = _logits(0, 4)  # k = 3
    draft = torch.softmax(_logits(1, 3), dim=-1)
    sampler = Sampler(0)
    target = _target_probs(sampler, logits, params)
    first, runs = _first_tokens(logits, params, draft, None, seed=1)
    assert _fits(first, target[0])
    # The token at output position 1, where there is one, is distributed as row 1's p.
    second = [run[1] for run in runs if len(run) > 1]
    assert len(second) > 1000 and _fits(second, target[1])
    # The test has power: the drafts themselves are far from the target.
    assert not _fits([int(torch.multinomial(draft[0], 1)) for _ in range(TRIALS)], target[0])


def test_point_mass_drafts_keep_the_target_distribution_under_top_k_top_p():
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.9, max_tokens=100)
    logits = _logits(2, 3)
    sampler = Sampler(0)
    target = _target_probs(sampler, logits, params)
    likely = int(target[0].argmax())
    first, runs = _first_tokens(logits, params, None, [likely, 3], seed=2)
    assert _fits(first, target[0])
    second = [run[1] for run in runs if len(run) > 1]
    assert _fits(second, target[1])


def test_penalties_apply_to_each_row_with_the_drafts_before_it():
    # Row 1 sees draft 0 in the output: a frequency penalty moves its distribution.
    params = SamplingParams(temperature=1.0, frequency_penalty=2.0, max_tokens=100)
    logits = _logits(3, 2)
    logits[0, 4] = 4.0  # draft 4 is usually accepted at row 0
    sampler = Sampler(0)
    first, runs = _first_tokens(logits, params, None, [4], seed=3)
    penalized = logits[1].clone()
    penalized[4] -= 2.0
    target_after = torch.softmax(penalized, dim=-1)
    second = [run[1] for run in runs if run[0] == 4]
    assert _fits(second, target_after)
    assert not _fits(second, torch.softmax(logits[1], dim=-1))
    del sampler


def test_greedy_accepts_while_drafts_are_the_argmax():
    logits = _logits(4, 4)
    best = logits.argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0, max_tokens=100)
    drafts = [best[0], best[1], (best[2] + 1) % VOCAB]
    [result] = verify(Sampler(0), logits, [VerifyRequest(_rows(params, drafts), drafts)])
    assert result.token_ids == [best[0], best[1], best[2]]
    all_right = best[:3]
    [result] = verify(Sampler(0), logits, [VerifyRequest(_rows(params, all_right), all_right)])
    assert result.token_ids == best  # three accepted and the bonus


def test_seeded_requests_get_the_same_tokens_alone_or_batched_and_logprobs_per_token():
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=100, logprobs=2)
    other = SamplingParams(temperature=1.0, max_tokens=100)
    logits = _logits(5, 3)
    drafts = [1, 2]
    alone = verify(Sampler(1), logits, [VerifyRequest(_rows(params, drafts), drafts)])[0]
    noise = _logits(6, 3)
    batched = verify(Sampler(2), torch.cat([noise, logits]), [
        VerifyRequest(_rows(other, drafts), drafts),
        VerifyRequest(_rows(params, drafts), drafts)])[1]
    assert alone.token_ids == batched.token_ids
    assert len(alone.logprobs) == len(alone.token_ids)
    for j, (token, entry) in enumerate(zip(alone.token_ids, alone.logprobs)):
        expected = torch.log_softmax(logits[j], dim=-1)[token].item()
        assert abs(entry[token].logprob - expected) < 1e-5
