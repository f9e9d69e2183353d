"""Tests of the batched sampler: greedy, truncation, distributions, seeds, penalties, logprobs."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from openinfer.sample.logits_processors import (
    apply_penalties,
    apply_token_constraints,
    apply_top_k_top_p,
    bad_word_bans,
)
from openinfer.sample.logprobs import compute_logprobs
from openinfer.sample.rows import SamplingRow
from openinfer.sample.sampler import Sampler, row_seed
from openinfer.sampling_params import SamplingParams


def make_row(
    params: SamplingParams | None = None,
    output: tuple[int, ...] = (),
    prompt: tuple[int, ...] = (),
    stop: frozenset[int] = frozenset(),
) -> SamplingRow:
    return SamplingRow(
        params=params or SamplingParams(),
        prompt_token_ids=prompt,
        output_token_ids=output,
        stop_token_ids=stop,
    )


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_input_untouched():
    logits = random_logits(8, 100)
    before = logits.clone()
    rows = [make_row(SamplingParams(temperature=0.0, top_k=3, top_p=0.5)) for _ in range(8)]
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8
    assert torch.equal(logits, before)


def test_greedy_on_bf16_logits_matches_the_float32_path():
    """Plain greedy rows take the argmax of the model's bf16 logits without widening them; the
    token is the one the float32 path (taken when a row asks for logprobs) picks, ties included."""
    logits = (random_logits(16, 3000, seed=3) * 0.05).to(torch.bfloat16)  # coarse: many ties
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # an exact tie for the top
    plain = Sampler(seed=0)(logits, [make_row(SamplingParams(temperature=0.0))] * 16)
    with_logprobs = Sampler(seed=0)(logits, [make_row(SamplingParams(temperature=0.0, logprobs=1))] * 16)
    assert plain.token_ids == with_logprobs.token_ids == logits.float().argmax(dim=-1).tolist()
    assert plain.token_ids[1] == 7
    assert plain.logprobs == [None] * 16 and with_logprobs.logprobs[0] is not None


def test_mixed_batch_greedy_rows_stay_argmax():
    logits = random_logits(6, 50, seed=1)
    before = logits.clone()
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=5.0)
    rows = [make_row(greedy if i % 2 == 0 else hot) for i in range(6)]
    out = Sampler(seed=0)(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
    assert all(0 <= t < 50 for t in out.token_ids)
    assert torch.equal(logits, before)


def test_logits_shape_must_match_rows():
    with pytest.raises(ValueError):
        Sampler(seed=0)(torch.zeros(2, 5), [make_row()])


# --------------------------------------------------------------------------------------------
# Truncation: a reference implementation in float64 numpy (vLLM v1 order:
# temperature -> min-p -> top-k -> top-p)
# --------------------------------------------------------------------------------------------


def reference_probs(
    logits: np.ndarray,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = np.argsort(-z, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        mass_before = 0.0
        for token in order:
            if not keep[token]:
                continue
            if mass_before >= top_p:
                keep[token] = False
            mass_before += q[token]
    final = np.where(keep, p, 0.0)
    return final / final.sum()


TRUNCATION_CASES = [
    dict(temperature=0.7, top_k=3),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=1.5, min_p=0.2),
    dict(temperature=1.2, top_k=10, top_p=0.7),
    dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
    dict(temperature=2.0, top_k=1),
]


@pytest.mark.parametrize("case", TRUNCATION_CASES, ids=lambda c: repr(c))
def test_truncation_restricts_support(case):
    vocab, num_rows = 64, 400
    base = random_logits(1, vocab, seed=3)[0]
    allowed = set(np.flatnonzero(reference_probs(base.numpy(), **case)).tolist())
    # Unrestricted rows sit in the same batch, so the per-row masks must not leak across rows.
    restricted = SamplingParams(**case)
    free = SamplingParams(temperature=case["temperature"])
    rows = [make_row(restricted if i % 4 else free) for i in range(num_rows)]
    out = Sampler(seed=11)(base.repeat(num_rows, 1), rows)
    sampled = {t for i, t in enumerate(out.token_ids) if i % 4}
    assert sampled <= allowed
    if len(allowed) > 1:
        assert len(sampled) > 1
    free_sampled = {t for i, t in enumerate(out.token_ids) if i % 4 == 0}
    if len(allowed) <= 3:
        assert free_sampled - allowed, "unrestricted rows must still reach the whole vocabulary"


def test_top_p_boundary_keeps_smallest_set_reaching_top_p():
    # Four tied tokens of probability 1/4 (exact in float): top_p = 0.5 is reached by two.
    logits = torch.zeros(3, 4)
    apply_top_k_top_p(logits, None, torch.tensor([0.5, 0.75, 1.0]))
    assert torch.isfinite(logits).sum(dim=-1).tolist() == [2, 3, 4]
    # top-k ties: the sort path keeps exactly k, the top-k-only path keeps ties with the k-th.
    logits = torch.tensor([[1.0, 0.0, 0.0, -1.0]] * 2)
    apply_top_k_top_p(logits, torch.tensor([2, 4]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(logits).sum(dim=-1).tolist() == [2, 4]
    logits = torch.tensor([[1.0, 0.0, 0.0, -1.0]] * 2)
    apply_top_k_top_p(logits, torch.tensor([2, 4]), None)
    assert torch.isfinite(logits).sum(dim=-1).tolist() == [3, 4]


def test_top_k_disabled_values_and_larger_than_vocab():
    vocab = 20
    base = random_logits(1, vocab, seed=4)[0]
    rows = [make_row(SamplingParams(top_k=k, temperature=3.0)) for k in (0, -1, 100, 2) * 100]
    out = Sampler(seed=5)(base.repeat(len(rows), 1), rows)
    top2 = set(base.topk(2).indices.tolist())
    assert {t for i, t in enumerate(out.token_ids) if i % 4 == 3} <= top2
    assert len({t for i, t in enumerate(out.token_ids) if i % 4 != 3} - top2) > 3


# --------------------------------------------------------------------------------------------
# Distributions
# --------------------------------------------------------------------------------------------

# A tiny vocabulary whose rank order differs from the id order.
TINY_LOGITS = np.array([0.5, 2.0, -1.0, 1.0, 0.0, 1.5], dtype=np.float32)

DISTRIBUTION_CASES = [
    dict(),
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=4),
    dict(top_p=0.8),
    dict(min_p=0.15),
    dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
    # min-p runs before top-p (vLLM v1): the nucleus is {1, 5}; top-p first would keep {1, 5, 3}.
    dict(top_p=0.7, min_p=0.3),
]


def assert_matches(counts: np.ndarray, expected: np.ndarray) -> None:
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts}"
    if support.sum() == 1:
        return
    result = chisquare(counts[support], expected[support] * counts.sum())
    assert result.pvalue > 1e-3, (counts, expected)


@pytest.mark.parametrize("case", DISTRIBUTION_CASES, ids=lambda c: repr(c))
def test_distribution_chisquare(case):
    num_samples = 20_000
    params = SamplingParams(**case)
    logits = torch.from_numpy(TINY_LOGITS).repeat(num_samples, 1)
    out = Sampler(seed=1234)(logits, [make_row(params)] * num_samples)
    counts = np.bincount(out.token_ids, minlength=len(TINY_LOGITS))
    assert_matches(counts, reference_probs(TINY_LOGITS, **case))


def test_distribution_of_seeded_rows_chisquare():
    # Each row has its own seed, so this checks the per-row noise path, not the batched one.
    num_samples = 5_000
    case = dict(temperature=1.1, top_p=0.95)
    rows = [make_row(SamplingParams(seed=s, **case)) for s in range(num_samples)]
    logits = torch.from_numpy(TINY_LOGITS).repeat(num_samples, 1)
    out = Sampler(seed=0)(logits, rows)
    counts = np.bincount(out.token_ids, minlength=len(TINY_LOGITS))
    assert_matches(counts, reference_probs(TINY_LOGITS, **case))


# --------------------------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------------------------

VOCAB = 1000
PROMPT = (1, 2, 3)


def step_logits(request: int, history: list[int]) -> torch.Tensor:
    """Fake model: the next logits depend on the request, position and last token."""
    last = history[-1] if history else 0
    seed = request * 1_000_003 + len(history) * 7919 + last
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def generate(
    sampler: Sampler,
    requests: list[tuple[int, SamplingParams]],
    steps: int,
    prefixes: list[list[int]] | None = None,
) -> list[list[int]]:
    histories = [list(p) for p in prefixes] if prefixes else [[] for _ in requests]
    for _ in range(steps):
        rows = [make_row(params, tuple(h), PROMPT) for (_, params), h in zip(requests, histories)]
        logits = torch.stack([step_logits(key, h) for (key, _), h in zip(requests, histories)])
        out = sampler(logits, rows)
        for history, token in zip(histories, out.token_ids):
            history.append(token)
    return histories


SEEDED = SamplingParams(seed=7, temperature=1.0, top_p=0.95)


def test_seeded_request_same_alone_and_in_busy_batch():
    alone = generate(Sampler(seed=1), [(0, SEEDED)], steps=12)[0]

    busy_sampler = Sampler(seed=2)
    # Advance the engine generator first: seeded rows must not care.
    generate(busy_sampler, [(9, SamplingParams()), (10, SamplingParams(top_k=5))], steps=3)
    busy = generate(
        busy_sampler,
        [
            (5, SamplingParams()),
            (1, SamplingParams(seed=8, temperature=0.8)),
            (0, SEEDED),
            (6, SamplingParams(temperature=0.0)),
            (7, SamplingParams(top_k=20, repetition_penalty=1.3)),
        ],
        steps=12,
    )
    assert busy[2] == alone
    assert len(set(alone)) > 1


def test_seeded_request_resumes_identically_after_preemption():
    alone = generate(Sampler(seed=1), [(0, SEEDED)], steps=12)[0]
    # A fresh sampler picks the request up at position 5 (recomputed after preemption).
    resumed = generate(Sampler(seed=99), [(0, SEEDED), (3, SamplingParams())], steps=7,
                       prefixes=[alone[:5], []])[0]
    assert resumed == alone


def test_different_seeds_give_different_tokens():
    a = generate(Sampler(seed=1), [(0, SEEDED)], steps=12)[0]
    other = SamplingParams(seed=8, temperature=1.0, top_p=0.95)
    b = generate(Sampler(seed=1), [(0, other)], steps=12)[0]
    assert a != b


def test_unseeded_rows_follow_the_engine_seed():
    requests = [(k, SamplingParams(temperature=1.0)) for k in range(4)]
    a = generate(Sampler(seed=42), requests, steps=8)
    b = generate(Sampler(seed=42), requests, steps=8)
    c = generate(Sampler(seed=43), requests, steps=8)
    assert a == b
    assert a != c


def test_row_seed_is_a_fixed_mix():
    # Fixed: another process (another hash seed) computes the same streams, so a seeded
    # request gives the same tokens after a restart.
    pairs = [(7, 3), (0, 0), (-5, 0), (2**70, 11), (1234, 4095)]
    code = (f"from openinfer.sample.sampler import row_seed; "
            f"print([row_seed(s, p) for s, p in {pairs!r}])")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == str([row_seed(s, p) for s, p in pairs])
    seeds = {row_seed(s, p) for s in range(20) for p in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    assert 0 <= row_seed(-5, 0) < 2**63


# --------------------------------------------------------------------------------------------
# Penalties and min_tokens
# --------------------------------------------------------------------------------------------

PENALTY_LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])


def test_all_penalties_hand_computed():
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    row = make_row(params, output=(3, 3, 4), prompt=(0, 1))
    out = apply_penalties(PENALTY_LOGITS, [row])
    # Repetition over prompt+output {0, 1, 3, 4}: positive / 2, negative * 2.
    # Then output counts {3: 2, 4: 1}: 3 -> 1.5 - 0.5 - 2*0.25; 4 -> -4 - 0.5 - 0.25.
    expected = torch.tensor([[1.0, -2.0, 0.5, 0.5, -4.75, 1.0]])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert torch.equal(PENALTY_LOGITS, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]))


def test_presence_and_frequency_ignore_prompt_tokens():
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=-0.5)
    row = make_row(params, output=(5, 5, 5), prompt=(0, 1, 2))
    out = apply_penalties(PENALTY_LOGITS, [row])
    expected = PENALTY_LOGITS.clone()
    expected[0, 5] = 1.0 - 1.0 + 1.5
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_penalties_only_touch_their_rows():
    plain = make_row(SamplingParams(), output=(3,), prompt=(0,))
    repeated = make_row(SamplingParams(repetition_penalty=0.5), output=(3,), prompt=(0,))
    logits = PENALTY_LOGITS.repeat(2, 1)
    out = apply_penalties(logits, [plain, repeated])
    assert torch.equal(out[0], logits[0])
    # A penalty < 1 favours repeats: 2 / 0.5 and 3 / 0.5.
    assert out[1, 0].item() == 4.0 and out[1, 3].item() == 6.0


def test_no_penalties_returns_input_unchanged():
    rows = [make_row(SamplingParams(), output=(1, 2), prompt=(3,), stop=frozenset({0}))]
    assert apply_penalties(PENALTY_LOGITS, rows) is PENALTY_LOGITS


def test_frequency_penalty_flips_greedy_choice():
    logits = torch.tensor([[0.0, 5.0, 4.0, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    sampler = Sampler(seed=0)
    # 5 - 0.6 = 4.4 > 4: one occurrence is not enough; two are (5 - 1.2 = 3.8 < 4).
    assert sampler(logits, [make_row(params, output=(1,))]).token_ids == [1]
    assert sampler(logits, [make_row(params, output=(1, 1))]).token_ids == [2]


def test_repetition_penalty_flips_greedy_choice_from_prompt():
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler(seed=0)(logits, [make_row(params, prompt=(1,))]).token_ids == [2]
    assert Sampler(seed=0)(logits, [make_row(params, prompt=(3,))]).token_ids == [1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_stop_tokens_until_reached(temperature):
    vocab, eos, stop = 8, 7, 2
    logits = torch.full((1, vocab), -30.0)
    logits[0, eos] = 20.0
    logits[0, stop] = 19.0
    logits[0, 4] = 0.0
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[stop])
    stops = frozenset({eos, stop, 1000})  # an id past the vocabulary is ignored
    sampler = Sampler(seed=0)
    batch = logits.repeat(50, 1)
    for generated in range(3):
        row = make_row(params, output=(4,) * generated, stop=stops)
        assert sampler(batch, [row] * 50).token_ids == [4] * 50
    row = make_row(params, output=(4,) * 3, stop=stops)
    assert set(sampler(batch, [row] * 50).token_ids) <= {eos, stop}


# --------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------


def test_compute_logprobs_values_and_ranks():
    logits = random_logits(3, 40, seed=8)
    expected = torch.log_softmax(logits, dim=-1)
    order = expected.argsort(dim=-1, descending=True)
    tokens = [order[0, 0].item(), order[1, 2].item(), order[2, 30].item()]
    result = compute_logprobs(logits, tokens, num_top=5)
    for r, entry in enumerate(result):
        top5 = order[r, :5].tolist()
        for rank, token in enumerate(top5, start=1):
            assert entry[token].rank == rank
        for token, logprob in entry.items():
            assert logprob.logprob == pytest.approx(expected[r, token].item(), abs=1e-6)
            assert logprob.decoded_token is None
    assert len(result[0]) == 5 and len(result[1]) == 5
    # Outside the top 5: included with its true rank.
    assert len(result[2]) == 6
    assert result[2][tokens[2]].rank == 31


def test_compute_logprobs_zero_top_and_tensor_tokens():
    logits = random_logits(2, 10, seed=9)
    tokens = torch.tensor([3, 7])
    result = compute_logprobs(logits, tokens, num_top=0)
    lp = torch.log_softmax(logits, dim=-1)
    for r, token in enumerate(tokens.tolist()):
        assert list(result[r]) == [token]
        assert result[r][token].rank == int((lp[r] > lp[r, token]).sum()) + 1


def test_compute_logprobs_ties_keep_ranks_distinct():
    # All tokens tie; the given token is one that topk did not list.
    listed = set(compute_logprobs(torch.zeros(1, 4), [0], num_top=2)[0]) - {0}
    token = next(t for t in range(4) if t not in listed and t != 0)
    result = compute_logprobs(torch.zeros(1, 4), [token], num_top=2)[0]
    assert token in result
    ranks = sorted(lp.rank for lp in result.values())
    assert ranks == list(range(1, len(result) + 1))


def test_sampler_logprobs_are_raw():
    logits = random_logits(3, 30, seed=10)
    rows = [
        make_row(SamplingParams(temperature=0.3, repetition_penalty=1.5, logprobs=3),
                 output=(1, 2), prompt=(0,)),
        make_row(SamplingParams(temperature=0.0)),
        make_row(SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=0), output=(4,)),
    ]
    out = Sampler(seed=0)(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for r in (0, 2):
        entry = out.logprobs[r]
        assert out.token_ids[r] in entry
        for token, logprob in entry.items():
            assert logprob.logprob == pytest.approx(raw[r, token].item(), abs=1e-6)
    top3 = raw[0].argsort(descending=True)[:3].tolist()
    assert all(out.logprobs[0][t].rank == i for i, t in enumerate(top3, start=1))
    assert list(out.logprobs[2]) == [out.token_ids[2]]


# --------------------------------------------------------------------------------------------
# Token constraints: logit_bias, allowed_token_ids, bad_words
# --------------------------------------------------------------------------------------------


def bad_words_params(sequences: list[list[int]], **kwargs) -> SamplingParams:
    """Params with bad words resolved to the given token sequences (as the input processor
    would with a tokenizer)."""
    params = SamplingParams(bad_words=[f"w{i}" for i in range(len(sequences))], **kwargs)
    params.set_bad_words_token_ids(sequences)
    return params


def test_logit_bias_flips_greedy_argmax_and_logprobs_stay_raw():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    before = logits.clone()
    params = SamplingParams(temperature=0.0, logit_bias={2: 1.6}, logprobs=1)
    out = Sampler(seed=0)(logits, [make_row(params)])
    assert out.token_ids == [2]  # 0.5 + 1.6 > 2.0
    raw = torch.log_softmax(before, dim=-1)
    assert out.logprobs[0][2].logprob == pytest.approx(raw[0, 2].item(), abs=1e-6)
    assert out.logprobs[0][0].rank == 1  # ranks too come from the raw logits
    assert torch.equal(logits, before)


def test_logit_bias_string_keys_act_like_int_keys():
    logits = random_logits(2, 40, seed=20)
    rows = [make_row(SamplingParams(temperature=0.0, logit_bias={"7": 100})),
            make_row(SamplingParams(temperature=0.0, logit_bias={7: 100}))]
    assert Sampler(seed=0)(logits, rows).token_ids == [7, 7]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 5.0])
def test_logit_bias_minus_100_bans_the_top_tokens(temperature):
    logits = random_logits(1, 20, seed=21, scale=2.0).repeat(400, 1)
    top = logits[0].topk(3).indices.tolist()
    params = SamplingParams(temperature=temperature, logit_bias={t: -100 for t in top})
    out = Sampler(seed=0)(logits, [make_row(params)] * 400)
    assert not set(out.token_ids) & set(top)
    assert temperature == 0.0 or len(set(out.token_ids)) > 3


def test_logit_bias_plus_100_forces_a_token_even_when_hot():
    logits = random_logits(200, 50, seed=22)
    rows = [make_row(SamplingParams(temperature=1.5, top_p=0.9, logit_bias={13: 100}))] * 200
    assert set(Sampler(seed=0)(logits, rows).token_ids) == {13}


@pytest.mark.parametrize("temperature", [0.0, 1.0, 10.0])
def test_allowed_token_ids_restrict_the_support(temperature):
    allowed = [3, 17, 40]
    logits = random_logits(500, 64, seed=23)
    params = SamplingParams(temperature=temperature, allowed_token_ids=allowed)
    out = Sampler(seed=0)(logits, [make_row(params)] * 500)
    assert set(out.token_ids) <= set(allowed)
    if temperature == 0.0:
        expected = torch.tensor(allowed)[logits[:, allowed].argmax(dim=-1)].tolist()
        assert out.token_ids == expected
    else:
        assert set(out.token_ids) == set(allowed)


def test_allowed_token_ids_win_over_logit_bias_outside_them():
    logits = random_logits(50, 30, seed=24)
    params = SamplingParams(temperature=1.0, allowed_token_ids=[1, 2], logit_bias={5: 100, 2: 3})
    out = Sampler(seed=0)(logits, [make_row(params)] * 50)
    assert set(out.token_ids) <= {1, 2}


def test_single_token_bad_word_is_always_banned():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    params = bad_words_params([[1]], temperature=0.0)
    for output in [(), (1,), (2, 3)]:
        assert Sampler(seed=0)(logits, [make_row(params, output=output)]).token_ids == [2]


def test_multi_token_bad_word_bans_its_last_token_only_after_its_prefix():
    params = bad_words_params([[7, 8, 9]], temperature=0.0)
    row = lambda output, prompt=(): make_row(params, output=output, prompt=prompt)  # noqa: E731
    assert bad_word_bans(row((1, 7, 8))) == [9]
    assert bad_word_bans(row((7, 8, 1))) == []
    assert bad_word_bans(row((8,))) == []            # too short for the prefix
    assert bad_word_bans(row((9, 8))) == []          # prefix out of order
    assert bad_word_bans(row((8,), prompt=(7,))) == []  # the prompt does not count (vLLM)

    logits = torch.zeros(2, 12)
    logits[:, 9] = 5.0
    logits[:, 4] = 4.0
    out = Sampler(seed=0)(logits, [row((7, 8)), row((8, 7))])
    assert out.token_ids == [4, 9]


def test_bad_words_several_sequences_and_allowed_ids_together():
    params = bad_words_params([[2], [5, 3], [6, 3]], temperature=0.0, allowed_token_ids=[2, 3, 4])
    logits = torch.tensor([[9.0, 0.0, 8.0, 7.0, 1.0, 0.0, 0.0]])
    assert Sampler(seed=0)(logits, [make_row(params, output=(5,))]).token_ids == [4]
    assert Sampler(seed=0)(logits, [make_row(params, output=(1,))]).token_ids == [3]


def test_logit_bias_comes_before_the_repetition_penalty():
    # vLLM order: (-1 + 2) / 2 = 0.5 > 0.25. Penalty first would give -1 * 2 + 2 = 0 < 0.25,
    # and no bias -2.
    logits = torch.tensor([[-1.0, 0.25, -5.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 2.0})
    assert Sampler(seed=0)(logits, [make_row(params, prompt=(0,))]).token_ids == [0]


def test_no_constraints_returns_input_unchanged():
    logits = random_logits(4, 20)
    rows = [make_row(SamplingParams(temperature=t, repetition_penalty=1.2)) for t in (0, 1, 2)]
    # Bad words the input processor has not resolved into token ids are nothing to apply yet.
    rows.append(make_row(SamplingParams(bad_words=["x"])))
    assert apply_token_constraints(logits, rows) is logits


def test_constraints_only_touch_their_rows_and_never_the_input():
    logits = random_logits(5, 40, seed=25)
    before = logits.clone()
    rows = [
        make_row(SamplingParams()),
        make_row(SamplingParams(logit_bias={3: -100, 4: 2.5})),
        make_row(SamplingParams(temperature=0.0)),
        make_row(SamplingParams(allowed_token_ids=[0, 39])),
        make_row(bad_words_params([[11], [1, 12]]), output=(1,)),
    ]
    out = apply_token_constraints(logits, rows)
    assert torch.equal(logits, before)
    for r in (0, 2):
        assert torch.equal(out[r], logits[r])
    expected = logits[1].clone()
    expected[3] -= 100
    expected[4] += 2.5
    assert torch.allclose(out[1], expected)
    assert torch.isfinite(out[3]).tolist() == [t in (0, 39) for t in range(40)]
    assert torch.equal(out[3, [0, 39]], logits[3, [0, 39]])
    assert torch.isinf(out[4]).nonzero().flatten().tolist() == [11, 12]


def test_seeded_row_same_alone_and_beside_constrained_rows():
    seeded = SamplingParams(seed=3, temperature=1.0)
    alone = generate(Sampler(seed=1), [(0, seeded)], steps=10)[0]
    busy = generate(
        Sampler(seed=2),
        [
            (4, SamplingParams(logit_bias={5: 100})),
            (0, seeded),
            (2, SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 3])),
            (3, bad_words_params([[alone[0]], [alone[1], alone[2]]], temperature=0.7)),
        ],
        steps=10,
    )
    assert busy[1] == alone
    assert set(busy[0]) == {5} and set(busy[2]) <= {1, 2, 3}
    assert alone[0] not in busy[3]


def test_seeded_row_with_constraints_is_batch_independent():
    params = SamplingParams(seed=11, temperature=1.0, allowed_token_ids=list(range(0, VOCAB, 3)),
                            logit_bias={0: 2.0})
    alone = generate(Sampler(seed=1), [(0, params)], steps=10)[0]
    busy = generate(Sampler(seed=5), [(7, SamplingParams()), (0, params)], steps=10)[1]
    assert busy == alone and all(t % 3 == 0 for t in alone)
