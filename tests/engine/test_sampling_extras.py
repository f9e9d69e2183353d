"""logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens through ``openinfer.LLM``
on the tiny random-weight checkpoint."""

from __future__ import annotations

import collections

import pytest
import torch

from openinfer import LLM, SamplingParams
from openinfer.engine.input_processor import bad_words_token_ids

TEXT = "Return the value of the given key"


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kwargs.pop("max_tokens", 24), ignore_eos=True,
                          **kwargs)


def _prompts(n: int = 4, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (k,), generator=g).tolist() for k in (7, 30, 18, 45)[:n]]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _contains(tokens: list[int], sequence: list[int]) -> bool:
    k = len(sequence)
    return any(tokens[i:i + k] == sequence for i in range(len(tokens) - k + 1))


@pytest.fixture(scope="module")
def llm(qwen3_checkpoint) -> LLM:
    return LLM(str(qwen3_checkpoint), progress=False)


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    return _tokens(llm.generate(_prompts(), greedy()))


# --------------------------------------------------------------------------------------------
# logit_bias
# --------------------------------------------------------------------------------------------


def test_strong_logit_bias_forces_a_token(llm, reference):
    token = next(t for t in range(100, 1000) if all(t not in r for r in reference))
    for bias in ({token: 100}, {str(token): 100}):
        outputs = _tokens(llm.generate(_prompts(), greedy(logit_bias=bias)))
        assert outputs == [[token] * 24] * len(reference)
    # Sampled rows too.
    sampled = llm.generate(_prompts(), SamplingParams(temperature=1.0, max_tokens=8,
                                                      logit_bias={token: 100}, ignore_eos=True))
    assert all(set(o.outputs[0].token_ids) == {token} for o in sampled)


def test_logit_bias_minus_100_bans_the_greedy_choice(llm, reference):
    banned = {r[0] for r in reference}
    outputs = _tokens(llm.generate(_prompts(), greedy(logit_bias={t: -100 for t in banned})))
    assert all(not banned & set(out) for out in outputs)
    assert outputs != reference


def test_logprobs_stay_raw_under_logit_bias(llm, reference):
    plain = llm.generate(_prompts(1), greedy(max_tokens=1, logprobs=2))[0].outputs[0]
    token = next(t for t in range(100, 1000) if t not in plain.logprobs[0])
    biased = llm.generate(_prompts(1), greedy(max_tokens=1, logprobs=2,
                                              logit_bias={token: 100}))[0].outputs[0]
    assert biased.token_ids == [token]
    for t, lp in plain.logprobs[0].items():  # the same top tokens, values and ranks
        assert biased.logprobs[0][t].logprob == pytest.approx(lp.logprob, abs=1e-5)
        assert biased.logprobs[0][t].rank == lp.rank
    assert biased.logprobs[0][token].logprob < plain.logprobs[0][plain.token_ids[0]].logprob


# --------------------------------------------------------------------------------------------
# allowed_token_ids
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_limit_the_output(llm, temperature):
    allowed = [11, 250, 499, 777, 1000]
    params = SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True,
                            allowed_token_ids=allowed, seed=3)
    outputs = _tokens(llm.generate(_prompts(), params))
    assert all(set(out) <= set(allowed) for out in outputs)
    if temperature:
        assert len(set().union(*outputs)) > 1


def test_n_children_carry_allowed_ids_and_bias(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, ignore_eos=True, seed=1,
                            allowed_token_ids=[5, 6, 7, 8], logit_bias={8: -100})
    [out] = llm.generate(_prompts(1), params)
    assert len(out.outputs) == 3
    assert all(set(c.token_ids) <= {5, 6, 7} for c in out.outputs)


# --------------------------------------------------------------------------------------------
# bad_words
# --------------------------------------------------------------------------------------------


def _frequent_word(tokenizer, token_ids: list[int]) -> str:
    """The most frequent output token whose text is a word of 3+ letters (as a bad word)."""
    words = collections.Counter(tokenizer.decode([t]).strip() for t in token_ids)
    return next(w for w, _ in words.most_common() if w.isalpha() and len(w) >= 3)


def test_bad_word_never_appears(llm):
    tokenizer = llm.get_tokenizer()
    plain = llm.generate(TEXT, greedy())[0].outputs[0]
    word = _frequent_word(tokenizer, plain.token_ids)
    assert word in plain.text
    out = llm.generate(TEXT, greedy(bad_words=[word]))[0].outputs[0]
    assert word not in out.text
    for sequence in bad_words_token_ids(tokenizer, [word]):
        assert not _contains(out.token_ids, sequence)
    # The output runs as before up to the first place the word was generated.
    first = next(i for i, t in enumerate(plain.token_ids) if word in tokenizer.decode([t]))
    assert out.token_ids[:first] == plain.token_ids[:first]


def test_multi_token_bad_word_bans_the_sequence_not_its_tokens(llm):
    tokenizer = llm.get_tokenizer()
    plain = llm.generate(TEXT, greedy())[0].outputs[0].token_ids
    # Two consecutive output tokens whose text tokenizes back to them.
    pair = next([a, b] for a, b in zip(plain, plain[1:])
                if tokenizer.encode(tokenizer.decode([a, b]), add_special_tokens=False) == [a, b]
                and tokenizer.decode([a, b]).strip() == tokenizer.decode([a, b]))
    word = tokenizer.decode(pair)
    out = llm.generate(TEXT, greedy(bad_words=[word]))[0].outputs[0].token_ids
    assert not _contains(out, pair)
    assert pair[0] in out  # its first token alone is still allowed


def test_n_children_and_sampling_respect_bad_words(llm):
    tokenizer = llm.get_tokenizer()
    plain = llm.generate(TEXT, greedy())[0].outputs[0]
    word = _frequent_word(tokenizer, plain.token_ids)
    params = SamplingParams(n=3, temperature=0.8, max_tokens=24, ignore_eos=True, seed=0,
                            bad_words=[word], logit_bias={t: 5 for t in plain.token_ids})
    [out] = llm.generate(TEXT, params)
    sequences = bad_words_token_ids(tokenizer, [word])
    for child in out.outputs:
        assert not any(_contains(child.token_ids, s) for s in sequences)


def test_bad_words_need_a_tokenizer(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), skip_tokenizer_init=True, progress=False)
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate([[1, 2, 3]], greedy(bad_words=["foo"]))


# --------------------------------------------------------------------------------------------
# Preemption
# --------------------------------------------------------------------------------------------


def test_constraints_survive_preemption(qwen3_checkpoint, llm):
    tokenizer = llm.get_tokenizer()
    plain = llm.generate(TEXT, greedy())[0].outputs[0]
    word = _frequent_word(tokenizer, plain.token_ids)
    params = [
        greedy(bad_words=[word]),
        greedy(allowed_token_ids=list(range(300, 340))),
        greedy(logit_bias={5: 100}),
        greedy(logit_bias={t: -100 for t in plain.token_ids[:4]}, bad_words=[word]),
    ]
    prompts = [TEXT, *_prompts(3)]
    expected = _tokens(llm.generate(prompts, params))
    # 24 blocks of 4 tokens: the requests need more together, so some are preempted.
    small = LLM(str(qwen3_checkpoint), block_size=4, kv_cache_memory=24 * 4 * 2 * 2 * 2 * 16 * 4,
                max_model_len=96, progress=False)
    assert _tokens(small.generate(prompts, params)) == expected
    assert small.engine.core.scheduler.num_preemptions > 0
    sequences = bad_words_token_ids(tokenizer, [word])
    assert not any(_contains(expected[0], s) for s in sequences)
    assert set(expected[1]) <= set(range(300, 340)) and set(expected[2]) == {5}


# --------------------------------------------------------------------------------------------
# truncate_prompt_tokens
# --------------------------------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    prompt = _prompts()[3]  # 45 tokens
    [truncated, direct] = llm.generate([prompt, prompt[-8:]],
                                       [greedy(truncate_prompt_tokens=8), greedy()])
    assert truncated.prompt_token_ids == prompt[-8:]
    assert truncated.outputs[0].token_ids == direct.outputs[0].token_ids
    # Longer than the prompt: nothing changes.
    [whole] = llm.generate([prompt], greedy(truncate_prompt_tokens=100))
    assert whole.prompt_token_ids == prompt


def test_truncate_prompt_tokens_on_text_prompts(llm):
    ids = llm.get_tokenizer().encode(TEXT)
    [truncated] = llm.generate(TEXT, greedy(truncate_prompt_tokens=3, max_tokens=6))
    [direct] = llm.generate([ids[-3:]], greedy(max_tokens=6))
    assert truncated.prompt_token_ids == ids[-3:]
    assert truncated.outputs[0].token_ids == direct.outputs[0].token_ids


def test_truncate_prompt_tokens_minus_one_fits_the_context(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), max_model_len=64, progress=False)
    prompt = list(range(10, 110))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([prompt], greedy(max_tokens=8))
    [out] = llm.generate([prompt], greedy(max_tokens=8, truncate_prompt_tokens=-1))
    assert out.prompt_token_ids == prompt[-56:]
    assert len(out.outputs[0].token_ids) == 8
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None,
                                                  truncate_prompt_tokens=-1, ignore_eos=True))
    assert out.prompt_token_ids == prompt[-63:] and len(out.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([prompt], greedy(max_tokens=64, truncate_prompt_tokens=-1))


def test_engine_add_request_truncates(llm):
    prompt = _prompts()[1]
    engine = llm.engine
    engine.add_request("t0", prompt, greedy(max_tokens=4, truncate_prompt_tokens=5))
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    assert done[0].prompt_token_ids == prompt[-5:]


# --------------------------------------------------------------------------------------------
# Validation against the model
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, kwargs", [
    ("logit_bias", lambda v: dict(logit_bias={v: 1.0})),
    ("logit_bias", lambda v: dict(logit_bias={str(v + 5): 1.0})),
    ("allowed_token_ids", lambda v: dict(allowed_token_ids=[1, v])),
])
def test_out_of_vocabulary_ids_name_the_field(llm, field, kwargs):
    vocab_size = llm.engine.inputs.vocab_size
    with pytest.raises(ValueError, match=field):
        llm.generate(_prompts(2), [greedy(), greedy(**kwargs(vocab_size))])
    # Nothing was queued (the autouse fixture checks the engine is idle).
    assert not llm.engine.has_unfinished_requests()


def test_validate_refuses_an_untruncated_prompt(llm):
    # A front end that skips InputProcessor.process/truncate must fail loudly, not silently
    # run the whole prompt.
    with pytest.raises(RuntimeError, match="truncate_prompt_tokens"):
        llm.engine.inputs.validate(list(range(20)), greedy(truncate_prompt_tokens=4))
