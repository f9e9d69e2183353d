"""What `openinfer bench serve` sends: sessions of turns, built from a named workload.

Every workload is a list of sessions. A session is one user: its turns go out one after
another, each after the previous answer arrived (plus think time), and a chat turn resends
the whole conversation so far, as chat clients do. Single-request workloads are sessions of
one turn. Prompts that must have an exact token count are sent as token ids to
``/v1/completions``; conversations go to ``/v1/chat/completions`` as text.

Random tokens are drawn from the ids that the tokenizer gives :data:`PROBE_TEXT`
(:func:`vocabulary`), not from the whole vocabulary: that needs nothing but ``encode`` (one
``/tokenize`` call when the tokenizer is the server's), never yields a special token, and makes
a workload depend only on the options and the tokenizer's answers, not on where it runs.
The tokenizer is asked in batches (one call per kind of question per build).
"""

from __future__ import annotations

import itertools
import json
import random
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from openinfer.bench import BenchError
from openinfer.bench.tokenizer import BenchTokenizer, as_bench_tokenizer

WORKLOADS = ("random", "shared-prefix", "multi-turn", "agentic", "sharegpt", "replay")

_WORDS = ["".join(letters) for n in (1, 2, 3) for letters in itertools.product(string.ascii_lowercase,
                                                                                repeat=n)]
PROBE_TEXT = " ".join([*_WORDS, *(w.capitalize() for w in _WORDS[:26 + 26 * 26]),
                       *map(str, range(1000)), *string.punctuation])
"""Every word of one to three lowercase letters, the capitalized ones of one or two letters,
the numbers 0-999 and the ASCII punctuation marks (about 80 kB): its token ids are the
vocabulary of random prompts (382 ids of the 1,024-token test tokenizer, 2,368 of SmolLM2's
49,152)."""


class WorkloadError(BenchError, ValueError):
    """A workload that cannot be built (bad options, a file that does not parse)."""


@dataclass
class Turn:
    output_len: int
    prompt_ids: list[int] | None = None
    """Completions: the whole prompt as token ids."""
    user_text: str | None = None
    """Chat: this turn's user message (the history is added when it is sent)."""
    pause_s: float | None = None
    """Seconds to wait after the last answer before sending this turn (a tool running);
    None: the workload's think time."""


@dataclass
class Session:
    turns: list[Turn]
    system: str | None = None
    arrival_s: float | None = None
    """Replay: when the session starts, in seconds from the start of the run."""


@dataclass
class Workload:
    name: str
    endpoint: Literal["completions", "chat"]
    sessions: list[Session]
    think_time_s: float = 0.0
    options: dict = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@dataclass(frozen=True)
class WorkloadOptions:
    num_requests: int = 100
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    """Lengths drawn uniformly from [len * (1 - r), len * (1 + r)]."""
    prefix_len: int = 512
    """shared-prefix: tokens of each group's system prompt; multi-turn: of the system prompt."""
    num_groups: int = 4
    prompts_per_group: int = 8
    num_users: int = 8
    num_turns: int = 4
    shared_system_prompt: bool = False
    """multi-turn: every user has the same system prompt (one app), not one each."""
    think_time_s: float = 0.0
    dataset: str | None = None
    replay_block_size: int = 512
    """replay: tokens behind one hash id of a Mooncake-format trace."""
    tool_time_s: float = 2.0
    """agentic: mean of the (exponential) pause while a tool runs, before its result is sent."""
    abandon_rate: float = 0.1
    """agentic: the share of sessions that stop after a random turn and never come back."""
    seed: int = 0


def build_workload(name: str, options: WorkloadOptions, tokenizer: BenchTokenizer | Any) -> Workload:
    """The named workload, the same for the same options and tokenizer answers.

    ``tokenizer``: a :class:`BenchTokenizer`, or a Hugging Face tokenizer (wrapped). Raises
    WorkloadError for bad options or files, ServerError when a server tokenizer fails."""
    tokenizer = as_bench_tokenizer(tokenizer)
    rng = random.Random(options.seed)
    vocab = vocabulary(tokenizer)
    if name == "random":
        sessions = [Session([Turn(_length(options.output_len, options, rng),
                                  prompt_ids=_random_ids(rng, vocab,
                                                         _length(options.input_len, options, rng)))])
                    for _ in range(options.num_requests)]
        return Workload(name, "completions", sessions, options=_dict(options))
    if name == "shared-prefix":
        return _shared_prefix(options, rng, vocab)
    if name == "multi-turn":
        return _multi_turn(options, rng, vocab, tokenizer)
    if name == "agentic":
        return _agentic(options, rng, vocab, tokenizer)
    if name == "sharegpt":
        return _sharegpt(options, rng, tokenizer)
    if name == "replay":
        return _replay(options, vocab)
    raise WorkloadError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def _shared_prefix(options: WorkloadOptions, rng: random.Random, vocab: list[int]) -> Workload:
    sessions = []
    for _ in range(options.num_groups):
        prefix = _random_ids(rng, vocab, options.prefix_len)
        for _ in range(options.prompts_per_group):
            question = _random_ids(rng, vocab, _length(options.input_len, options, rng))
            sessions.append(Session([Turn(_length(options.output_len, options, rng),
                                          prompt_ids=prefix + question)]))
    rng.shuffle(sessions)  # groups interleave, as users of one app do
    return Workload("shared-prefix", "completions", sessions, options=_dict(options))


def _multi_turn(options: WorkloadOptions, rng: random.Random, vocab: list[int],
                tokenizer: BenchTokenizer) -> Workload:
    # Draw every token first (the order fixes the workload), then decode them in one batch.
    shared = _random_ids(rng, vocab, options.prefix_len)
    users = []  # (system ids, [(output_len, user ids)])
    for _ in range(options.num_users):
        system = shared if options.shared_system_prompt else _random_ids(rng, vocab,
                                                                         options.prefix_len)
        users.append((system, [(_length(options.output_len, options, rng),
                                _random_ids(rng, vocab, _length(options.input_len, options, rng)))
                               for _ in range(options.num_turns)]))
    texts = tokenizer.decode([ids for system, turns in users
                              for ids in [system, *(user for _, user in turns)]])
    sessions, at = [], 0  # texts: each user's system prompt, then its turns
    for _, turns in users:
        system_text, user_texts = texts[at], texts[at + 1:at + 1 + len(turns)]
        at += 1 + len(turns)
        sessions.append(Session([Turn(output_len, user_text=text)
                                 for (output_len, _), text in zip(turns, user_texts)],
                                system=system_text))
    return Workload("multi-turn", "chat", sessions, think_time_s=options.think_time_s,
                    options=_dict(options))


def _agentic(options: WorkloadOptions, rng: random.Random, vocab: list[int],
             tokenizer: BenchTokenizer) -> Workload:
    """Agents of one app: a long system prompt with the tool definitions (``prefix_len``
    tokens, shared by every session), a task, then tool results: each turn after the first
    is a tool's output (``input_len`` tokens), sent after the tool ran (a pause drawn from an
    exponential of mean ``tool_time_s``). ``abandon_rate`` of the sessions stop after a
    random turn and never come back (their context, kept for them, is wasted)."""
    if not 0 <= options.abandon_rate <= 1 or options.tool_time_s < 0:
        raise WorkloadError("agentic: --abandon-rate is in [0, 1] and --tool-time >= 0")
    system = _random_ids(rng, vocab, options.prefix_len)
    plans = []  # (number of turns, [(output_len, ids, pause)])
    for _ in range(options.num_users):
        turns = options.num_turns
        if rng.random() < options.abandon_rate:
            turns = rng.randint(1, max(1, options.num_turns - 1))
        plans.append([(_length(options.output_len, options, rng),
                       _random_ids(rng, vocab, _length(options.input_len, options, rng)),
                       None if t == 0 else rng.expovariate(1 / options.tool_time_s)
                       if options.tool_time_s else 0.0) for t in range(turns)])
    texts = tokenizer.decode([system, *(ids for plan in plans for _, ids, _ in plan)])
    system_text, at, sessions = texts[0], 1, []
    for plan in plans:
        turns = []
        for t, (output_len, _, pause) in enumerate(plan):
            text = texts[at] if t == 0 else f"Tool result:\n{texts[at]}"
            turns.append(Turn(output_len, user_text=text, pause_s=pause))
            at += 1
        sessions.append(Session(turns, system="Tools you may call:\n" + system_text))
    return Workload("agentic", "chat", sessions, options=_dict(options))


def _sharegpt(options: WorkloadOptions, rng: random.Random, tokenizer: BenchTokenizer) -> Workload:
    """The first human message of each conversation; its first reply's length as output_len.
    Only the replies of the conversations chosen are tokenized."""
    data = _load_json(options.dataset, "sharegpt")
    if not isinstance(data, list):
        raise WorkloadError("a ShareGPT file is a JSON list of {'conversations': [...]} objects")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in (first, reply)):
            raise WorkloadError("ShareGPT turns are objects with 'from' and 'value' strings")
        pairs.append((first["value"], reply["value"]))
    if not pairs:
        raise WorkloadError(f"{options.dataset}: no conversation with at least two turns")
    rng.shuffle(pairs)
    chosen = [pairs[i % len(pairs)] for i in range(options.num_requests)]
    reply_ids = tokenizer.encode([reply for _, reply in chosen])
    return Workload("sharegpt", "chat", [Session([Turn(max(1, len(ids)), user_text=text)])
                                         for (text, _), ids in zip(chosen, reply_ids)],
                    options=_dict(options))


def _replay(options: WorkloadOptions, vocab: list[int]) -> Workload:
    """A Mooncake-format JSONL trace: {"timestamp" (ms), "input_length", "output_length",
    "hash_ids"}; requests that share a hash id share that block of prompt tokens."""
    if options.dataset is None:
        raise WorkloadError("the replay workload needs --dataset TRACE.jsonl")
    blocks: dict[int, list[int]] = {}
    sessions: list[Session] = []
    try:
        lines = Path(options.dataset).read_text().splitlines()
    except OSError as e:
        raise WorkloadError(f"cannot read {options.dataset}: {e}") from e
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            timestamp_ms = float(record["timestamp"])
            input_len, output_len = int(record["input_length"]), int(record["output_length"])
            hash_ids = [int(h) for h in record.get("hash_ids", [])]
        except (ValueError, KeyError, TypeError) as e:
            raise WorkloadError(f"{options.dataset}:{number}: not a trace record ({e})") from e
        ids: list[int] = []
        for h in hash_ids:
            if h not in blocks:
                block_rng = random.Random(f"{options.seed}:{h}")
                blocks[h] = _random_ids(block_rng, vocab, options.replay_block_size)
            ids += blocks[h]
        if len(ids) < input_len:  # a trace without (enough) hash ids: fresh tokens
            ids += _random_ids(random.Random(f"{options.seed}:line{number}"), vocab,
                               input_len - len(ids))
        sessions.append(Session([Turn(max(1, output_len), prompt_ids=ids[:input_len])],
                                arrival_s=timestamp_ms / 1000))
    if not sessions:
        raise WorkloadError(f"{options.dataset}: no trace records")
    start = min(s.arrival_s for s in sessions)
    for s in sessions:
        s.arrival_s -= start
    sessions.sort(key=lambda s: s.arrival_s)
    return Workload("replay", "completions", sessions, options=_dict(options))


def _load_json(path: str | None, name: str):
    if path is None:
        raise WorkloadError(f"the {name} workload needs --dataset PATH")
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise WorkloadError(f"cannot read {path} as JSON: {e}") from e


def vocabulary(tokenizer: BenchTokenizer) -> list[int]:
    """Token ids a random prompt may use: those of :data:`PROBE_TEXT`, sorted."""
    ids = sorted(set(tokenizer.encode([PROBE_TEXT])[0]))
    if not ids:
        raise WorkloadError(f"the tokenizer {tokenizer.name} gives no token for plain text")
    return ids


def _random_ids(rng: random.Random, vocab: list[int], n: int) -> list[int]:
    return [vocab[rng.randrange(len(vocab))] for _ in range(n)]


def _length(mean: int, options: WorkloadOptions, rng: random.Random) -> int:
    low = max(1, round(mean * (1 - options.range_ratio)))
    high = max(low, round(mean * (1 + options.range_ratio)))
    return rng.randint(low, high)


def _dict(options: WorkloadOptions) -> dict:
    return {k: v for k, v in vars(options).items() if v is not None}
