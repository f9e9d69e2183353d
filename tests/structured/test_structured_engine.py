"""Structured outputs through ``openinfer.LLM`` on the tiny random-weight model, where only
the grammar mask can make an output valid: JSON schemas (hypothesis-generated), regex,
choice, Lark and GBNF grammars; and the fast paths (speculative decoding, preemption, prefix
caching, batching, seeds) give the same tokens as the plain path."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
import torch
from conftest import run_disaggregated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openinfer import LLM, SamplingParams
from openinfer.structured.grammar import grammar_text
from openinfer.structured.params import StructuredOutputsParams

PROMPTS = [[5, 17, 99, 4, 250], [7, 7, 31, 600, 2, 8, 9, 120, 44], [300, 301, 302]]


@pytest.fixture(scope="module")
def llm(qwen3_checkpoint) -> LLM:
    return LLM(str(qwen3_checkpoint), progress=False)


def _json(schema: dict, **params) -> SamplingParams:
    params.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs={"json": schema, "disable_any_whitespace": True},
                          **params)


def _texts(outputs) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for o in outputs for c in o.outputs]


def _valid_prefix(llm: LLM, so: StructuredOutputsParams, token_ids: list[int]) -> bool:
    """Whether the grammar accepts every token (an output cut by max_tokens)."""
    matcher = llm.engine.core.structured.compiler.matcher(so)
    return all(matcher.consume_token(t) for t in token_ids) and not matcher.is_error()


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
def test_hypothesis_schemas_outputs_validate(llm, schema, seed):
    params = _json(schema, temperature=1.0, seed=seed, n=2)
    for completion in (c for o in llm.generate([PROMPTS[seed % 3]], params) for c in o.outputs):
        if completion.finish_reason == "length":
            # A nested schema can outgrow max_tokens (a CI run drew an array of two objects of
            # objects): what was written must still be a prefix the grammar accepts.
            so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
            assert _valid_prefix(llm, so, list(completion.token_ids)), (schema, completion.text)
            continue
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_without_the_constraint_the_model_writes_no_json(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=30))
    for text, _ in _texts(outs):
        with pytest.raises(ValueError):
            json.loads(text)


def test_json_object_regex_choice_and_grammars(llm):
    cases = {
        "json_object": ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
        "regex": ({"regex": r"[0-9]{3}-[a-z]{2,4}"},
                  lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        "choice": ({"choice": ["yes", "no way", "maybe"]}, lambda t: t in ("yes", "no way", "maybe")),
        "lark": ({"grammar": 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'},
                 lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
        "gbnf": ({"grammar": 'root ::= "say " word\nword ::= [a-z]+ "."'},
                 lambda t: re.fullmatch(r"say [a-z]+\.", t)),
    }
    for name, (so, ok) in cases.items():
        outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, max_tokens=200,
                                                    structured_outputs=so))
        for text, finish in _texts(outs):
            if finish == "length":  # an unbounded grammar may run out: still a valid prefix
                continue
            assert finish == "stop" and ok(text), (name, text)


def test_unsatisfiable_within_max_tokens_finishes_with_length(llm):
    so = {"regex": "a{60}"}
    outs = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, structured_outputs=so))
    c = outs[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    assert _valid_prefix(llm, StructuredOutputsParams(**so), c.token_ids)


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


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "items": {
        "type": "string", "maxLength": 4}, "maxItems": 3},
    "n": {"type": "integer", "minimum": 0, "maximum": 99999}},
    "required": ["name", "tags"], "additionalProperties": False}


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


def test_seeded_samples_are_batch_independent_with_n(llm):
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=60, structured_outputs={
        "json": SCHEMA, "disable_any_whitespace": True})
    alone = _texts(llm.generate(PROMPTS[:1], params))
    busy = _texts(llm.generate(PROMPTS, params))[:3]
    assert alone == busy and len({t for t, _ in alone}) > 1
    for text, finish in alone:
        if finish == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)


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
    assert end  # the server's reasoning parser gives the tokenizer's ids for the tag


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
