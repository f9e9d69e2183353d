"""Structured outputs through ``openinfer.LLM`` on the tiny random-weight model, where only
the grammar mask can make an output valid: JSON schemas (hypothesis-generated), regex,
choice, Lark and GBNF grammars; and the fast paths (speculative decoding, preemption, prefix
caching, batching, seeds) give the same tokens as the plain path."""

from __future__ import annotations

import json
import re

import grammar_check
import jsonschema
import llguidance
import pytest
import torch
from conftest import run_disaggregated
from grammar_check import GrammarCheck
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openinfer import LLM, SamplingParams
from openinfer.structured.grammar import grammar_text
from openinfer.structured.params import StructuredOutputsParams

PROMPTS = [[5, 17, 99, 4, 250], [7, 7, 31, 600, 2, 8, 9, 120, 44], [300, 301, 302]]


@pytest.fixture(scope="module")
def llm(qwen3_checkpoint) -> LLM:
    return LLM(str(qwen3_checkpoint), progress=False)


@pytest.fixture(scope="module")
def check(qwen3_checkpoint) -> GrammarCheck:
    """The test's own matchers, for outputs cut by max_tokens."""
    return GrammarCheck(qwen3_checkpoint)


def _json(schema: dict, **params) -> SamplingParams:
    params.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs={"json": schema, "disable_any_whitespace": True},
                          **params)


def _texts(outputs) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for o in outputs for c in o.outputs]


# ---- schemas: hypothesis generates them, the output validates -------------------------------

_leaf = st.one_of(
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 1000)),
    st.builds(lambda values: {"enum": values},
              st.lists(st.sampled_from(["a", "b c", 1, 2.5, True, None]), min_size=1,
                       max_size=3, unique_by=json.dumps)),
)
_schema = st.recursive(_leaf, lambda inner: st.one_of(
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
              inner, st.integers(0, 3)),
    st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), inner, min_size=1,
                    max_size=3).map(lambda props: {
                        "type": "object", "properties": props, "required": sorted(props)[:2],
                        "additionalProperties": False}),
), max_leaves=6)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schema, seed=st.integers(0, 1000))
def test_hypothesis_schemas_outputs_validate(llm, check, schema, seed):
    params = _json(schema, temperature=1.0, seed=seed, n=2)
    grammar = grammar_check.json_schema(schema, any_whitespace=False)
    for completion in (c for o in llm.generate([PROMPTS[seed % 3]], params) for c in o.outputs):
        if completion.finish_reason == "length":
            # A nested schema can outgrow max_tokens (a CI run drew an array of two objects of
            # objects): what was written must still be a prefix the grammar accepts.
            assert check.accepts_prefix(grammar, completion.token_ids), (schema, completion.text)
            continue
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_without_the_constraint_the_model_writes_no_json(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=30))
    for text, _ in _texts(outs):
        with pytest.raises(ValueError):
            json.loads(text)


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "items": {
        "type": "string", "maxLength": 4}, "maxItems": 3},
    "n": {"type": "integer", "minimum": 0, "maximum": 99999}},
    "required": ["name", "tags"], "additionalProperties": False}


REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no way", "maybe"]
LARK = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
GBNF = 'root ::= "say " word\nword ::= [a-z]+ "."'
CASES = {  # name: (the request's constraint, the test's own grammar, a finished output's check)
    "json_object": ({"json_object": True}, grammar_check.json_schema({"type": "object"}),
                    lambda t: isinstance(json.loads(t), dict)),
    "regex": ({"regex": REGEX}, grammar_check.regex(REGEX), lambda t: re.fullmatch(REGEX, t)),
    "choice": ({"choice": CHOICES}, grammar_check.choice(CHOICES), lambda t: t in CHOICES),
    "lark": ({"grammar": LARK}, grammar_check.lark(LARK),
             lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
    "gbnf": ({"grammar": GBNF}, grammar_check.gbnf(GBNF), lambda t: re.fullmatch(r"say [a-z]+\.", t)),
}
# An open JSON object or a GBNF word rarely ends on a random model (at a random '"' or
# '.'): a bias towards the closing tokens ends most within the budget. Only the grammar
# makes the result valid (where '"' or '}' may not come, the mask refuses them).
CLOSING = {"json_object": ['"', "}", '",'], "gbnf": ["."]}


def _closing_bias(check: GrammarCheck, name: str) -> dict:
    ids = check.hf_tokenizer.convert_tokens_to_ids(CLOSING.get(name, []))
    return {"logit_bias": {i: 5.0 for i in ids}} if ids else {}


def _check_outputs(check: GrammarCheck, name: str, completions) -> None:
    """Finished outputs pass the case's check; outputs cut by max_tokens are prefixes its
    grammar accepts; at least one finished (so the check ran)."""
    _, grammar, ok = CASES[name] if name in CASES else MIXED_ONLY[name]
    finished = 0
    for c in completions:
        if c.finish_reason == "length":  # an unbounded grammar may run out
            assert check.accepts_prefix(grammar, c.token_ids), (name, c.text)
            continue
        assert c.finish_reason == "stop" and ok(c.text), (name, c.text, c.finish_reason)
        finished += 1
    assert finished, (name, [c.text for c in completions])


def test_json_object_regex_choice_and_grammars(llm, check):
    for name, (so, _, _) in CASES.items():
        outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, max_tokens=200,
                                                    structured_outputs=so,
                                                    **_closing_bias(check, name)))
        _check_outputs(check, name, [c for o in outs for c in o.outputs])


MIXED_ONLY = {
    "json": ({"json": SCHEMA, "disable_any_whitespace": True},
             grammar_check.json_schema(SCHEMA, any_whitespace=False),
             lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
}


def test_a_batch_mixing_grammars_and_free_requests(llm, check):
    """One ``generate``: requests under six different grammars between unconstrained ones.
    Each row gets its own request's mask: constrained outputs satisfy their own grammar (the
    test's checks, not the engine's), and the free rows are those of a batch without any
    constraint (a mask on the wrong row would constrain them)."""
    cases = {**CASES, **MIXED_ONLY}
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts, params, names = [], [], []
    for i, (name, (so, _, _)) in enumerate(cases.items()):
        for j in range(2):
            prompts.append(PROMPTS[(i + j) % 3])
            params.append(SamplingParams(temperature=1.0, seed=10 * i + j, n=2, max_tokens=120,
                                         structured_outputs=so, **_closing_bias(check, name)))
            names.append(name)
        prompts.append(PROMPTS[i % 3][::-1])
        params.append(free)
        names.append(None)
    outs = llm.generate(prompts, params)
    for name in cases:
        _check_outputs(check, name, [c for o, n in zip(outs, names) if n == name
                                     for c in o.outputs])
    free_prompts = [p for p, n in zip(prompts, names) if n is None]
    expected = [o.outputs[0].token_ids for o in llm.generate(free_prompts, free)]
    assert [o.outputs[0].token_ids for o, n in zip(outs, names) if n is None] == expected


def test_unsatisfiable_within_max_tokens_finishes_with_length(llm, check):
    so = {"regex": "a{60}"}
    outs = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, structured_outputs=so))
    c = outs[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    assert check.accepts_prefix(grammar_check.regex("a{60}"), c.token_ids)
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert not check.accepts_prefix(grammar_check.regex("a{60}"), free.token_ids), free.text


@pytest.mark.parametrize("bad, field", [
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"json": {"type": "objec"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"jsonn": {}}, "structured_outputs.jsonn"),
])
def test_invalid_grammars_are_refused_before_queueing(llm, bad, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=bad))
    # ... and the engine keeps serving.
    assert _texts(llm.generate(PROMPTS[:1], SamplingParams(
        max_tokens=4, structured_outputs={"choice": ["ok"]})))[0] == ("ok", "stop")


def _greedy_json(**params) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=60, **params, structured_outputs={
        "json": SCHEMA, "disable_any_whitespace": True})


def test_fast_paths_give_the_plain_paths_tokens(qwen3_checkpoint, llm):
    prompts = PROMPTS * 2
    plain_outputs = llm.generate(prompts, _greedy_json())
    plain = [o.outputs[0].token_ids for o in plain_outputs]
    for text, finish in _texts(plain_outputs):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    # Alone vs batched, and a second time (prefix cache hit, cached compiled grammar).
    alone = [llm.generate([p], _greedy_json())[0].outputs[0].token_ids for p in prompts[:3]]
    assert alone == plain[:3]
    assert llm.engine.core.structured.compiler.num_cache_hits > 0
    # Preemption: a tiny KV pool recomputes requests, the matcher keeps its place.
    small = LLM(str(qwen3_checkpoint), block_size=4, kv_cache_memory=24 * 4 * 2 * 2 * 2 * 16 * 4,
                max_model_len=96, progress=False)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, _greedy_json())] == plain
    assert small.engine.core.scheduler.num_preemptions > 0
    # Speculative decoding: drafts the grammar refuses are cut, masks cover every draft row.
    for method in ("ngram", "suffix"):
        spec = LLM(str(qwen3_checkpoint), progress=False, speculative_config={
            "method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 1})
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, _greedy_json())]
        assert got == plain, method
        assert spec.engine.core.stats()["spec_num_draft_tokens"] > 0, method


def test_disaggregated_decode_builds_the_matcher_from_the_prompt(qwen3_checkpoint, llm):
    """The decode instance gets the prompt's KV and the constraint: its matcher starts at
    the output's first token, as a colocated run's does."""
    so = {"json": SCHEMA, "disable_any_whitespace": True}
    prompts = [[(7 * i + 3 * j) % 900 + 10 for j in range(40)] for i in range(3)]  # 2+ blocks
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy_json())]
    tokens, _, decode = run_disaggregated(qwen3_checkpoint, prompts, dict(
        temperature=0, max_tokens=60, structured_outputs=so))
    assert tokens == plain
    assert decode.engine.core.scheduler.num_remote_blocks_pulled == 3 * 2  # pulled, not recomputed


def test_seeded_samples_are_batch_independent_with_n(llm, check):
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=60, structured_outputs={
        "json": SCHEMA, "disable_any_whitespace": True})
    alone_outputs = llm.generate(PROMPTS[:1], params)
    alone = _texts(alone_outputs)
    busy = _texts(llm.generate(PROMPTS, params))[:3]
    assert alone == busy and len({t for t, _ in alone}) > 1
    _check_outputs(check, "json", alone_outputs[0].outputs)


def test_stop_strings_cut_the_constrained_output(llm):
    so = {"regex": "abc-def-ghi"}
    outs = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=20, stop=["-g"],
                                                    structured_outputs=so))
    assert _texts(outs) == [("abc-def", "stop")]


def test_constraint_starts_after_the_reasoning_end(llm):
    """The output is free until the end-of-reasoning tokens, constrained after them."""
    tokenizer = llm.engine.inputs.tokenizer
    end = tokenizer.encode("</think>", add_special_tokens=False)
    # Force the reasoning to end at once: a logit bias on its tokens would leak into the
    # constrained part, so the gate here is a token the model emits anyway (its argmax).
    first = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1))[0]
    gate = tuple(first.outputs[0].token_ids)
    so = {"choice": ["yes", "no"], "start_after_token_ids": gate}
    c = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10,
                                                 structured_outputs=so))[0].outputs[0]
    assert c.token_ids[:1] == list(gate)
    assert tokenizer.decode(c.token_ids[1:]) in ("yes", "no") and c.finish_reason == "stop"
    # The server's reasoning parser gates with the tokenizer's ids for the tag.
    from openinfer.server.reasoning import get_reasoning_parser
    assert tokenizer.decode(end) == "</think>"
    assert get_reasoning_parser("deepseek_r1", tokenizer).end_token_ids() == end


def test_grammar_text_kinds():
    for so in ({"json": {"type": "integer"}}, {"regex": "x+"}, {"choice": ["a"]},
               {"grammar": "start: \"a\""}, {"json_object": True}):
        text = grammar_text(StructuredOutputsParams(**so))
        assert llguidance.LLMatcher.validate_grammar(text) == ""


@pytest.mark.parametrize("vocab, rows", [(1000, [0, 1, 2, 3]), (49152, [1, 3]), (77, [2])])
def test_mask_kernel_equals_the_torch_unpacking(vocab, rows):
    """The CPU kernel and the torch formulation refuse the same logits: random words, and
    words all set / all clear (the kernel's two shortcuts)."""
    from openinfer.kernels.cpu_attention import load_cpu_attention
    from openinfer.sample.logits_processors import refused_tokens

    kernels = load_cpu_attention()
    if kernels is None:
        pytest.skip("the CPU extension does not build here")
    g = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    packed = torch.randint(-2**31, 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int32)
    packed[:, ::3] = -1
    packed[:, 1::5] = 0
    logits = torch.randn(4, vocab, generator=g)
    expected = logits.clone()
    expected[rows] = expected[rows].masked_fill(refused_tokens(packed, vocab), float("-inf"))
    kernels.apply_token_bitmask(logits, packed, torch.tensor(rows))
    assert torch.equal(logits, expected)
