"""Reasoning parsers: what each puts in ``reasoning_content`` and ``content`` (vLLM's
semantics, made prompt-aware), streaming agreeing with the whole-text split for any
chunking, and the end tag's token ids the engine waits for before structured outputs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openinfer.server.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningSplit,
    get_reasoning_parser,
)

# Generation prompts as the models' chat templates end them.
R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜><think>\n"
QWEN3_PROMPT = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
QWEN35_PROMPT = QWEN3_PROMPT + "<think>\n"  # Qwen3.5 / Thinking-2507: the template opens it.
QWEN3_NO_THINK_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"  # enable_thinking=False
# An earlier turn's reasoning says nothing about this turn: only the prompt's end counts.
QWEN3_HISTORY_PROMPT = ("<|im_start|>assistant\n<think>\nearlier\n</think>\n\ncall<|im_end|>\n"
                        "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n")

# (parser, prompt, output, reasoning_content, content). Text is verbatim, as in vLLM: the
# newlines after </think> stay in content; a field is None only when empty.
CASES = [
    # DeepSeek-R1: starts inside reasoning whatever the prompt (unless it closed it).
    ("deepseek_r1", R1_PROMPT, "Add.\n</think>\n\n4", "Add.\n", "\n\n4"),
    ("deepseek_r1", R1_PROMPT, "Add them up", "Add them up", None),  # cut off thinking
    ("deepseek_r1", None, "<think>Add.</think>4", "Add.", "4"),
    ("deepseek_r1", None, "\n<think>\nAdd.</think>4", "\nAdd.", "4"),
    ("deepseek_r1", None, "Add.</think>4", "Add.", "4"),
    ("deepseek_r1", None, "<think>Add.", "Add.", None),
    ("deepseek_r1", QWEN3_PROMPT, "plain answer", "plain answer", None),
    ("deepseek_r1", R1_PROMPT, "</think>4", None, "4"),
    ("deepseek_r1", R1_PROMPT, "Add.</think>", "Add.", None),
    ("deepseek_r1", QWEN3_NO_THINK_PROMPT, "4", None, "4"),
    ("deepseek_r1", R1_PROMPT, "", None, None),
    # A later <think> is literal reasoning; after the first </think> all is content.
    ("deepseek_r1", R1_PROMPT, "a <think> b</think>c</think>", "a <think> b", "c</think>"),
    # Qwen3: the model writes <think> itself.
    ("qwen3", QWEN3_PROMPT, "<think>\nAdd.\n</think>\n\n4", "\nAdd.\n", "\n\n4"),
    ("qwen3", QWEN3_PROMPT, "<think>\nAdd them", "\nAdd them", None),  # cut off thinking
    ("qwen3", QWEN3_PROMPT, "<think>\n\n</think>\n\n4", "\n\n", "\n\n4"),  # /no_think
    ("qwen3", QWEN3_PROMPT, "4", None, "4"),  # a model that does not think
    ("qwen3", QWEN3_PROMPT, "  4 is <think>", None, "  4 is <think>"),
    ("qwen3", QWEN3_PROMPT, "4</think>", None, "4</think>"),
    ("qwen3", QWEN3_PROMPT, "<thi", None, "<thi"),  # cut off inside the tag
    ("qwen3", QWEN3_PROMPT, "", None, None),
    ("qwen3", QWEN3_HISTORY_PROMPT, "<think>r</think>4", "r", "4"),
    # Qwen3.5 / Thinking-2507: the prompt opens reasoning.
    ("qwen3", QWEN35_PROMPT, "Add.\n</think>\n\n4", "Add.\n", "\n\n4"),
    ("qwen3", QWEN35_PROMPT, "Add them", "Add them", None),
    ("qwen3", QWEN35_PROMPT, "<think>Add.</think>4", "Add.", "4"),
    # enable_thinking=False: the prompt closed it, the output is all content.
    ("qwen3", QWEN3_NO_THINK_PROMPT, "4", None, "4"),
    ("qwen3", QWEN3_NO_THINK_PROMPT, "<think>4</think>", None, "<think>4</think>"),
    # No prompt: vLLM's current qwen3 parser (reasoning until </think>).
    ("qwen3", None, "<think>Add.</think>4", "Add.", "4"),
    ("qwen3", None, "Add.</think>4", "Add.", "4"),
    ("qwen3", None, "Add them", "Add them", None),
]


def _parser(name: str) -> ReasoningParser:
    return get_reasoning_parser(name, tokenizer=None)


def _stream(parser: ReasoningParser, chunks: list[str], prompt: str | None) -> ReasoningSplit:
    """Joins a streamer's deltas the way a client joins the chunks it receives."""
    streamer = parser.streamer(prompt)
    reasoning, content = [], []
    for chunk in chunks:
        r, c = streamer.feed(chunk)
        reasoning.append(r)
        content.append(c)
    r, c = streamer.finish()
    reasoning.append(r)
    content.append(c)
    return ReasoningSplit("".join(reasoning) or None, "".join(content) or None)


@pytest.mark.parametrize(("name", "prompt", "output", "reasoning", "content"), CASES)
def test_split(name, prompt, output, reasoning, content):
    assert _parser(name).split(output, prompt) == ReasoningSplit(reasoning, content)


@pytest.mark.parametrize(("name", "prompt", "output", "reasoning", "content"), CASES)
def test_streaming_equals_split_for_any_chunking(name, prompt, output, reasoning, content):
    parser = _parser(name)
    expected = ReasoningSplit(reasoning, content)
    assert _stream(parser, [output], prompt) == expected
    assert _stream(parser, list(output), prompt) == expected
    for i in range(len(output) + 1):
        for j in range(i, len(output) + 1):
            chunks = [output[:i], output[i:j], output[j:]]
            assert _stream(parser, chunks, prompt) == expected, chunks


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("prompt", [R1_PROMPT, QWEN3_PROMPT, None])
def test_tags_never_leak(name, prompt):
    """A well-formed output's tags are structure, not text, in every chunking."""
    parser = _parser(name)
    output = "<think>\nweigh <b>bold</b> options\n</think>\n\nthe answer <is> 4"
    for chunks in ([output], list(output), [output[:5], output[5:30], output[30:]]):
        split = _stream(parser, chunks, prompt)
        assert split == parser.split(output, prompt)
        assert split.reasoning_content == "\nweigh <b>bold</b> options\n"
        assert split.content == "\n\nthe answer <is> 4"


def test_streamer_holds_back_only_a_possible_tag():
    """Text goes out as soon as no tag can still form from it: clients see reasoning live."""
    streamer = _parser("deepseek_r1").streamer(R1_PROMPT)
    assert streamer.feed("Let me </th") == ("Let me ", "")
    assert streamer.feed("ought") == ("</thought", "")
    assert streamer.feed("t. <") == ("t. ", "")
    assert streamer.feed("/think>\n") == ("", "\n")
    assert streamer.feed("4") == ("", "4")
    assert streamer.finish() == ("", "")

    streamer = _parser("qwen3").streamer(QWEN3_PROMPT)
    assert streamer.feed("\n<th") == ("", "")  # may still be <think>
    assert streamer.feed("e answer") == ("", "\n<the answer")
    assert streamer.finish() == ("", "")

    streamer = _parser("deepseek_r1").streamer(R1_PROMPT)
    assert streamer.feed("Hmm </thi") == ("Hmm ", "")
    assert streamer.finish() == ("</thi", "")  # cut off: the partial tag was text


# Output alphabet rich in tag fragments, so random texts hit partial and split tags.
_PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "</thi", "nk>", ">", "\n",
                           " ", "a", "b", "think"])


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(REASONING_PARSERS)),
       prompt=st.sampled_from([R1_PROMPT, QWEN3_PROMPT, QWEN35_PROMPT, QWEN3_NO_THINK_PROMPT,
                               None]),
       output=st.lists(_PIECES, max_size=12).map("".join),
       cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=6))
def test_streaming_equals_split_random(name, prompt, output, cuts):
    parser = _parser(name)
    bounds = sorted({min(c, len(output)) for c in cuts} | {0, len(output)})
    chunks = [output[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _stream(parser, chunks, prompt) == parser.split(output, prompt)


def test_starts_in_reasoning_and_prompt_closes_reasoning():
    r1, qwen3 = _parser("deepseek_r1"), _parser("qwen3")
    assert r1.starts_in_reasoning(R1_PROMPT)
    assert r1.starts_in_reasoning(QWEN3_PROMPT)  # R1 may skip <think>: assumed open
    assert not r1.starts_in_reasoning(QWEN3_NO_THINK_PROMPT)
    assert qwen3.starts_in_reasoning(QWEN35_PROMPT)
    assert not qwen3.starts_in_reasoning(QWEN3_PROMPT)  # the model opens it, if at all
    assert not qwen3.starts_in_reasoning(QWEN3_HISTORY_PROMPT)
    assert not qwen3.starts_in_reasoning(QWEN3_NO_THINK_PROMPT)
    for parser in (r1, qwen3):
        assert parser.prompt_closes_reasoning(QWEN3_NO_THINK_PROMPT)
        assert not parser.prompt_closes_reasoning(QWEN3_HISTORY_PROMPT)
        assert not parser.prompt_closes_reasoning(R1_PROMPT)


def test_registry():
    assert dict(REASONING_PARSERS) == {"deepseek_r1": DeepSeekR1ReasoningParser,
                                       "qwen3": Qwen3ReasoningParser}
    assert isinstance(get_reasoning_parser("qwen3", None), Qwen3ReasoningParser)
    with pytest.raises(ValueError, match="known: deepseek_r1, qwen3"):
        get_reasoning_parser("granite", None)


def _tiny_tokenizer(tags_as_tokens: bool):
    """A byte-level BPE trained here over a few strings (no hub access); with
    ``tags_as_tokens`` the think tags are added as special tokens, as real models have."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["let me think about it", "the answer is 4", "a paged KV cache"],
                            trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok)
    if tags_as_tokens:
        wrapped.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return wrapped


def test_end_token_ids_with_a_real_tokenizer():
    tok = _tiny_tokenizer(tags_as_tokens=True)
    parser = get_reasoning_parser("qwen3", tok)
    ids = parser.end_token_ids()
    assert ids == [tok.convert_tokens_to_ids("</think>")]
    assert tok.decode(ids) == "</think>"
    # The engine finds the sequence in the output's ids to start the grammar there.
    output = tok.encode("<think>let me think</think>the answer is 4", add_special_tokens=False)
    assert any(output[i:i + len(ids)] == ids for i in range(len(output)))


def test_end_token_ids_when_the_tag_is_several_tokens():
    tok = _tiny_tokenizer(tags_as_tokens=False)
    ids = get_reasoning_parser("deepseek_r1", tok).end_token_ids()
    assert len(ids) > 1
    assert tok.decode(ids) == "</think>"


def test_end_token_ids_needs_a_tokenizer():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        _parser("deepseek_r1").end_token_ids()
