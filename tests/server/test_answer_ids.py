"""A conversation that comes back runs the ids its answers were generated as (server/answer_ids.py),
with the demo tokenizer's ChatML template and Qwen3's own template."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from openinfer.server.answer_ids import AnswerIds, ChatEncoding, spans_concatenate
from openinfer.server.prompt import PromptRenderer

QWEN3_TEMPLATE = (Path(__file__).parent.parent / "fixtures" / "qwen3_chat_template.jinja").read_text()
"""Qwen3's chat template as its tokenizer_config.json ships it."""
SYSTEM = {"role": "system", "content": "You answer in one short sentence."}


@pytest.fixture
def tok(tokenizer):
    return copy.deepcopy(tokenizer)


def _generated(tok, text: str) -> list[int]:
    """Ids a model could sample for ``text`` that its encoder never gives: one per character."""
    ids = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]
    assert tok.decode(ids) == text and ids != tok.encode(text, add_special_tokens=False)
    return ids


def _turn(renderer: PromptRenderer, answers: AnswerIds, messages: list[dict],
          salt: str | None = None, **kwargs) -> tuple[list[int], ChatEncoding]:
    encoding = ChatEncoding(answers, salt)
    return renderer.chat(messages, encode=encoding, **kwargs), encoding


@pytest.mark.parametrize("template", [None, QWEN3_TEMPLATE], ids=["chatml", "qwen3"])
def test_a_returning_conversation_runs_its_generated_ids(tok, template):
    tok.chat_template = template or tok.chat_template
    renderer, answers = PromptRenderer(tok), AnswerIds(tok, 1 << 16)
    history = [SYSTEM, {"role": "user", "content": "What is a paged KV cache?"}]
    turn_ids, encoding = _turn(renderer, answers, history)
    assert turn_ids == renderer.chat(history)  # nothing known yet: as the tokenizer encodes
    for n, answer in enumerate(["A cache of keys and values in pages.", "Blocks, shared."]):
        generated = _generated(tok, answer)
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        answers.record(encoding.text, answer, generated + [eos], None)  # the EOS is left out
        history += [{"role": "assistant", "content": answer},
                    {"role": "user", "content": f"And then {n}?"}]
        next_ids, encoding = _turn(renderer, answers, history)
        # This turn's ids lead with the last one's and what it generated: all of it hits.
        assert next_ids[:len(turn_ids) + len(generated)] == turn_ids + generated
        assert tok.decode(next_ids) == encoding.text  # the same text, other ids
        assert next_ids != renderer.chat(history)
        turn_ids = next_ids
    assert answers.num_spliced == 3
    # Another tenant's conversation with the same text encodes as the tokenizer does.
    assert _turn(renderer, answers, history, salt="other")[0] == renderer.chat(history)


def test_answers_the_template_rewrites_encode_as_before(tok):
    """Qwen3 drops an earlier turn's reasoning, and renders an answer without the empty think
    block its generation prompt had under enable_thinking=False: nothing is found, the prompt
    is the tokenizer's encoding."""
    tok.chat_template = QWEN3_TEMPLATE
    renderer, answers = PromptRenderer(tok), AnswerIds(tok, 1 << 16)
    ask = [{"role": "user", "content": "Two and two?"}]
    for answer, kwargs in [("<think>\nAdd.\n</think>\n\nFour.", {}),
                           ("Four.", {"chat_template_kwargs": {"enable_thinking": False}})]:
        _, encoding = _turn(renderer, answers, ask, **kwargs)
        answers.record(encoding.text, answer, _generated(tok, answer), None)
        history = [*ask, {"role": "assistant", "content": answer},
                   {"role": "user", "content": "Sure?"}]
        assert _turn(renderer, answers, history, **kwargs)[0] == renderer.chat(history, **kwargs)
    assert answers.num_spliced == 0


def test_what_is_recorded_and_how_much(tok):
    answers = AnswerIds(tok, 40)
    ids = _generated(tok, "Paged attention.")
    answers.record("prompt", "Paged atten", ids, None)  # a stop string cut the text: no
    answers.record("prompt", "", [], None)
    assert answers.num_tokens == 0
    for i in range(6):  # the bound: least recently used answers go first
        answers.record(f"prompt {i}", f"answer {i}.", _generated(tok, f"answer {i}."), None)
    assert answers.num_tokens <= 40
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert answers.encode("prompt 5answer 5.<|im_end|>", ["answer 5."], None) == (
        encode("prompt 5") + _generated(tok, "answer 5.") + encode("<|im_end|>"))
    assert answers.encode("prompt 6answer 5.", ["answer 5."], None) == encode(
        "prompt 6answer 5.")  # after another prompt: not this answer
    assert answers.encode("prompt 0answer 0.", ["answer 0."], None) == encode(
        "prompt 0answer 0.")  # dropped
    assert not AnswerIds(tok, 0).enabled


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: every encoding starts with a word boundary (a space)."""
    model = Tokenizer(models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Metaspace()
    model.train_from_iterator(["Hello world, x and y.\n"] * 20,
                              trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"],
                                                  show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=model)


def test_only_tokenizers_whose_encodings_concatenate_splice(tok):
    assert spans_concatenate(tok)
    metaspace = _metaspace_tokenizer()
    assert not spans_concatenate(metaspace) and not AnswerIds(metaspace, 1 << 16).enabled
