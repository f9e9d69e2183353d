"""Incremental detokenization: whole characters only, deltas that add up, stop strings."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from openinfer.demo import build_demo_tokenizer
from openinfer.engine import detokenizer as detok_module
from openinfer.engine.detokenizer import IncrementalDetokenizer
from openinfer.sampling_params import SamplingParams

MIXED = (
    "Hello, world! Emoji 😀👍🏽 and flags 🇯🇵; CJK 中文文本，日本語のテキスト; "
    "accents naïve café — done.\nNew line\ttab 👨‍👩‍👧 end"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_demo_tokenizer(1024)


def feed(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes=None):
    """Feeds ids in chunks; returns (deltas, stop string or None)."""
    deltas = []
    i = 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        stop = detok.update(ids[i:i + n])
        i += n
        deltas.append(detok.get_delta(finished=stop is not None or i >= len(ids)))
        if stop is not None:
            return deltas, stop
    return deltas, None


def assert_clean(deltas: list[str]) -> None:
    for delta in deltas:
        assert "\ufffd" not in delta
        # A lone surrogate would mean a character was split.
        delta.encode("utf-8")


def test_one_token_at_a_time_matches_decode(tokenizer) -> None:
    ids = tokenizer.encode(MIXED)
    assert len(ids) > len(MIXED) // 2  # the small vocab splits multibyte chars into bytes
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    deltas, stop = feed(detok, ids)
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids) == MIXED
    assert "".join(deltas) == MIXED
    assert_clean(deltas)


def test_text_never_holds_a_partial_character(tokenizer) -> None:
    ids = tokenizer.encode("😀中")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    seen = []
    for token_id in ids:
        detok.update([token_id])
        seen.append(detok.output_text)
    assert all("\ufffd" not in text for text in seen)
    assert seen[-1] == "😀中"
    assert "" in seen  # the first byte tokens of 😀 produce no text yet


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_chunking(tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = tokenizer.encode(MIXED * 2)
    sizes = [rng.randint(1, 7) for _ in ids]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    deltas, _ = feed(detok, ids, sizes)
    assert detok.output_text == MIXED * 2
    assert "".join(deltas) == MIXED * 2
    assert_clean(deltas)


def test_stop_string_across_tokens(tokenizer) -> None:
    text = "Some text before 😀 the STOP marker 中文 and after it"
    ids = tokenizer.encode(text)
    stop = "the STOP marker 中"
    assert len(tokenizer.encode(stop)) > 3
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=stop))
    deltas, matched = feed(detok, ids)
    assert matched == stop
    assert detok.output_text == "Some text before 😀 "
    assert "".join(deltas) == detok.output_text
    assert all("STOP" not in d and "the S" not in d for d in deltas)
    assert_clean(deltas)
    # Later tokens change nothing.
    assert detok.update(tokenizer.encode(" more")) is None
    assert detok.output_text == "Some text before 😀 "


def test_include_stop_str_in_output(tokenizer) -> None:
    ids = tokenizer.encode("alpha beta END gamma")
    params = SamplingParams(stop=["END"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, params)
    deltas, matched = feed(detok, ids)
    assert matched == "END"
    assert detok.output_text == "alpha beta END"
    assert "".join(deltas) == "alpha beta END"


def test_earliest_stop_string_wins(tokenizer) -> None:
    ids = tokenizer.encode("one two three four")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["four", "three", "two t"]))
    _, matched = feed(detok, ids, [len(ids)])  # all at once: order in the list must not matter
    assert matched == "two t"
    assert detok.output_text == "one "


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_overlapping_stops_do_not_depend_on_chunking(tokenizer, chunk: int) -> None:
    # "bcd" completes before "abcde" does, so it wins however the text arrives.
    ids = tokenizer.encode("xx abcdef")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["abcde", "bcd"]))
    _, matched = feed(detok, ids, [chunk] * len(ids))
    assert matched == "bcd"
    assert detok.output_text == "xx a"


def test_stop_string_within_one_token(tokenizer) -> None:
    ids = tokenizer.encode("return value")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop="urn"))
    deltas, matched = feed(detok, ids)
    assert matched == "urn"
    assert detok.output_text == "ret"
    assert "".join(deltas) == "ret"


def test_delta_holds_back_possible_stop_prefix(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["STOP"]))
    detok.update(tokenizer.encode("abcdef ST"))
    assert detok.output_text == "abcdef ST"
    assert detok.get_delta() == "abcdef"  # "len(STOP) - 1" chars are held back
    assert detok.get_delta() == ""
    assert detok.get_delta(finished=True) == " ST"
    assert detok.get_delta(finished=True) == ""


def test_no_stop_strings_no_holdback(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    detok.update(tokenizer.encode("abc"))
    assert detok.get_delta() == "abc"


def test_min_tokens_defers_stop_strings(tokenizer) -> None:
    ids = tokenizer.encode("ab ab ab")
    assert [tokenizer.decode([i]) for i in ids] == ["ab", " ab", " ab"]
    params = SamplingParams(stop=["ab"], min_tokens=2, max_tokens=20)
    detok = IncrementalDetokenizer(tokenizer, params)
    # Like EOS, a stop string cannot end the output within the first min_tokens tokens.
    assert detok.update(ids[:1]) is None
    assert detok.update(ids[1:2]) is None
    assert detok.update(ids[2:]) == "ab"
    assert detok.output_text == "ab ab "
    # The same when all tokens arrive in one update.
    at_once = IncrementalDetokenizer(tokenizer, params)
    assert at_once.update(ids) == "ab"
    assert at_once.output_text == "ab ab "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip: bool) -> None:
    ids = tokenizer.encode("hi<|im_end|>there<|endoftext|>")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip))
    deltas, _ = feed(detok, ids)
    expected = "hithere" if skip else "hi<|im_end|>there<|endoftext|>"
    assert detok.output_text == expected == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected


def test_disabled(tokenizer) -> None:
    ids = tokenizer.encode("abc STOP")
    for detok in (IncrementalDetokenizer(tokenizer, SamplingParams(detokenize=False, stop="S")),
                  IncrementalDetokenizer(None, SamplingParams(stop="S"))):
        assert detok.update(ids) is None
        assert detok.output_text == ""
        assert detok.get_delta(finished=True) == ""


def test_ids_past_the_tokenizer_vocab_are_ignored(tokenizer) -> None:
    # The demo models pad the vocab; a random model may sample ids the tokenizer lacks.
    ids = tokenizer.encode("ab") + [len(tokenizer) + 7] + tokenizer.encode("cd")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    detok.update(ids)
    assert detok.output_text == "abcd"


def test_decode_token(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(detokenize=False))
    (word,) = tokenizer.encode(" the")
    assert detok.decode_token(word) == " the"
    assert detok.decode_token(tokenizer.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
    # Partial UTF-8 bytes get their distinct raw vocabulary strings, not U+FFFD.
    first, second = tokenizer.encode("😀")[:2]
    assert "\ufffd" not in detok.decode_token(first)
    assert detok.decode_token(first) != detok.decode_token(second)


class SlowTokenizer:
    """A tokenizer without a `tokenizers` backend: forces the full re-decode path."""

    def __init__(self, fast: PreTrainedTokenizerFast):
        self._fast = fast

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_id):
        return self._fast.convert_ids_to_tokens(token_id)


def test_slow_tokenizer_fallback(tokenizer) -> None:
    ids = tokenizer.encode(MIXED)
    detok = IncrementalDetokenizer(SlowTokenizer(tokenizer), SamplingParams(stop="flags 🇯🇵;"))
    deltas, matched = feed(detok, ids)
    assert matched == "flags 🇯🇵;"
    assert detok.output_text == MIXED[: MIXED.index("flags")]
    assert "".join(deltas) == detok.output_text
    assert_clean(deltas)


def test_stream_error_falls_back_to_full_decode(tokenizer, monkeypatch) -> None:
    calls = {"n": 0}
    real_step = detok_module._StreamDecoder.step

    def flaky_step(self, token_id):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("Invalid prefix encountered")
        return real_step(self, token_id)

    monkeypatch.setattr(detok_module._StreamDecoder, "step", flaky_step)
    ids = tokenizer.encode(MIXED)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    deltas, _ = feed(detok, ids)
    assert calls["n"] == 5  # the stream is not used after it failed
    assert detok.output_text == MIXED
    assert "".join(deltas) == MIXED


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer ('▁' for spaces, leading space stripped on decode)."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, said the fox"] * 20
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_prompt_context_keeps_leading_space(metaspace_tokenizer) -> None:
    tok = metaspace_tokenizer
    prompt = tok.encode("the quick brown")
    output = tok.encode("fox jumps")
    assert tok.decode(output) == "fox jumps"

    plain = IncrementalDetokenizer(tok, SamplingParams())
    plain.update(output)
    assert plain.output_text == "fox jumps"

    primed = IncrementalDetokenizer(tok, SamplingParams(), prompt_token_ids=prompt)
    for token_id in output:
        primed.update([token_id])
    assert primed.output_text == " fox jumps"
    assert tok.decode(prompt + output).endswith(primed.output_text)
