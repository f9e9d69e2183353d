"""Structured outputs: a grammar's cost (per decode step, to compile, in TTFT) and its worth.

The model is the built-in SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32); one
``LLM`` (256 sequences, prefix caching) serves every part. Four measurements, each against an
unconstrained baseline measured in the same run:

1. Decode under a JSON schema at batch 1, 32 and 256: B chat requests that all decode the whole
   window (greedy, ignore_eos, a fixed number of tokens; the schema, an object with an array of
   at least 200 strings of 20+ characters, cannot be completed in that many tokens), timed step
   by step over the steps where all B requests decode, constrained and plain rounds alternated.
   Beside it, the mask itself without the model: llguidance matchers over SmolLM2's tokenizer
   in different states, ``fill_next_token_bitmask_par`` on an ``LLExecutor`` (what
   ``StructuredOutputManager`` runs during the forward pass) and openinfer's
   ``apply_token_constraints`` on [B, V] float32 logits (in place, as the runner's sampler
   does when no row returns logprobs), per step, as a share of a plain decode step at that
   batch size.
2. Grammar compile time through ``GrammarCompiler.matcher``: cold (a grammar it has not seen;
   the median over distinct grammars, one property name or literal varied) and cached (the
   same grammar again: a deep copy), plus the first mask after the cold compile, for a small
   schema, a ~50-property schema (nested objects, enums, arrays), a regex and a Lark grammar.
3. Time to first token (``LLM.generate`` with max_tokens=1, after a warm-up) with the large
   schema vs unconstrained, each call with a prompt of its own: cold (a schema this engine has
   not seen) and warm (seen before).
4. A JSON extraction task: short chat prompts asking for a person's name, age and city as
   JSON, greedy, at most 80 tokens; the share of answers that parse and validate (jsonschema)
   with the schema as a constraint vs asked for in the prompt only (a ```json fence stripped).

    .venv/bin/python benchmarks/bench_structured.py [--no-write] [--smoke]

``--smoke`` runs tiny sizes (batches 1 and 4, a few tokens): about a minute on 2 quiet cores.
The full run takes about 4-5 minutes on 2 quiet cores (batch 256 is most of it); it waits up
to 10 s before each timed phase for other processes to leave the CPUs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import jsonschema
import llguidance
import llguidance.torch
import torch
from doc_sections import write_section
from offline_limits import cpu_busy_seconds, wait_until_quiet

from openinfer import LLM, SamplingParams
from openinfer.sample.logits_processors import apply_token_constraints
from openinfer.sample.rows import SamplingRow
from openinfer.structured.grammar import GrammarCompiler
from openinfer.structured.params import StructuredOutputsParams

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2"
MAX_NUM_SEQS, MAX_MODEL_LEN = 256, 1024
KV_CACHE_MEMORY = 3 * 1024**3 // 2
"""Room for 256 sequences of ~130 tokens (a ~40-token prompt and the decode window, with room
to spare) at 46 KB a token."""


@dataclass(frozen=True)
class Sizes:
    batch_sizes: tuple[int, ...]
    decode_tokens: int
    """Output tokens per request in the decode runs (the first comes from the prefill)."""
    rounds: int
    """Runs of each arm (plain, constrained) per batch size, alternated."""
    mask_steps: int
    compile_trials: int
    ttft_trials: int
    people: int
    extract_tokens: int
    quiet_wait_s: float
    """Before each timed phase, wait up to this long for other processes to leave the CPUs."""


FULL = Sizes(batch_sizes=(1, 32, 256), decode_tokens=32, rounds=2, mask_steps=16,
             compile_trials=7, ttft_trials=5, people=20, extract_tokens=80, quiet_wait_s=10)
SMOKE = Sizes(batch_sizes=(1, 4), decode_tokens=5, rounds=1, mask_steps=3,
              compile_trials=2, ttft_trials=2, people=3, extract_tokens=32, quiet_wait_s=0)

# --------------------------------------------------------------------------- grammars

DECODE_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "minLength": 20,
                                                        "maxLength": 200},
                             "minItems": 200, "maxItems": 1000}},
    "required": ["items"], "additionalProperties": False,
}
"""At least 200 strings of 20+ characters: no request completes it within the window."""
DECODE_CONSTRAINT = {"json": DECODE_SCHEMA, "disable_any_whitespace": True}

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"}},
    "required": ["name", "age", "city"], "additionalProperties": False,
}

AREAS = ("customer", "account", "billing", "shipping", "contact",
         "order", "payment", "product", "support", "profile")


def large_schema(tag: str = "") -> dict:
    """~50 properties: per area a string, an integer, an enum, an array and a nested object
    (with a pattern and an enum inside); every other property required."""
    address = {"type": "object", "additionalProperties": False,
               "properties": {"street": {"type": "string", "maxLength": 60},
                              "city": {"type": "string", "maxLength": 40},
                              "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                              "country": {"enum": ["US", "CA", "GB", "DE", "FR", "JP"]}},
               "required": ["street", "city", "country"]}
    properties: dict[str, dict] = {}
    for area in AREAS:
        properties[f"{area}_name"] = {"type": "string", "maxLength": 40}
        properties[f"{area}_count"] = {"type": "integer", "minimum": 0, "maximum": 100000}
        properties[f"{area}_status"] = {"enum": ["new", "active", "paused", "closed", "unknown"]}
        properties[f"{area}_tags"] = {"type": "array", "items": {"type": "string", "maxLength": 20},
                                      "maxItems": 5}
        properties[f"{area}_address"] = address
    properties[f"customer_name{tag}"] = properties.pop("customer_name")
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "required": list(properties)[::2]}


def small_schema(tag: str = "") -> dict:
    schema = json.loads(json.dumps(PERSON_SCHEMA))
    schema["properties"][f"city{tag}"] = schema["properties"].pop("city")
    schema["required"] = list(schema["properties"])
    return schema


def lark_grammar(tag: str = "") -> str:
    """A subset of SQL's SELECT."""
    return rf"""
start: "SELECT " columns " FROM " table (" WHERE " condition (" AND " condition)*)? ";"
columns: "*" | column (", " column)*
column: /[a-z_]{{1,20}}/
table: "orders{tag}" | "customers" | /[a-z_]{{1,20}}/
condition: column " " op " " value
op: "=" | "<" | ">" | "<=" | ">=" | "!="
value: /[0-9]{{1,9}}/ | /'[a-zA-Z ]{{0,30}}'/
"""


GRAMMARS: dict[str, Callable[[str], dict]] = {
    "small JSON schema (3 properties)": lambda tag: {"json": small_schema(tag)},
    "large JSON schema (50 properties)": lambda tag: {"json": large_schema(tag)},
    "regex": lambda tag: {"regex": rf"(id{tag}-)?[A-Z]{{2}}[0-9]{{4}} [0-9]{{4}}-[0-9]{{2}}-[0-9]{{2}} "
                                   r"[a-z]{1,20}@[a-z]{1,20}\.(com|org|net)"},
    "Lark grammar (SQL SELECT)": lambda tag: {"grammar": lark_grammar(tag)},
}

# --------------------------------------------------------------------------- prompts

TOPICS = ("the ocean", "volcanoes", "bread", "chess", "honey bees", "the moon", "trains",
          "coffee", "rainforests", "bicycles", "glaciers", "jazz", "owls", "deserts", "paper",
          "tomatoes", "lighthouses", "kites", "salt", "penguins", "castles", "tea", "comets",
          "maps", "wolves", "rivers", "clocks", "mushrooms", "bridges", "whales", "cheese",
          "libraries")
ASKS = ("List short facts about {} as JSON.", "Give me a JSON list of notes on {}.",
        "Write down things a child could learn about {}, in JSON.",
        "Name interesting details about {} as a JSON array of sentences.",
        "Collect trivia about {} in a JSON object.", "Summarize {} as JSON items.",
        "What should a tourist know about {}? Answer in JSON.",
        "Make a JSON list of questions about {}.")

PEOPLE: tuple[tuple[str, str, int, str], ...] = (
    ("Maria Lopez is a 34-year-old nurse who lives in Madrid.", "Maria Lopez", 34, "Madrid"),
    ("At 52, Tom Becker still runs his bakery in Hamburg.", "Tom Becker", 52, "Hamburg"),
    ("Aiko Tanaka, 27, moved to Osaka last spring.", "Aiko Tanaka", 27, "Osaka"),
    ("The new teacher, James Miller, is 41 and comes from Chicago.", "James Miller", 41, "Chicago"),
    ("Priya Sharma (age 30) works as an engineer in Bangalore.", "Priya Sharma", 30, "Bangalore"),
    ("Lucas Martin lives in Lyon. He turned 19 in May.", "Lucas Martin", 19, "Lyon"),
    ("Our neighbour Anna Kowalski is 65 years old and has lived in Warsaw all her life.",
     "Anna Kowalski", 65, "Warsaw"),
    ("Carlos Silva, a 45-year-old taxi driver from Lisbon, found the wallet.",
     "Carlos Silva", 45, "Lisbon"),
    ("Emma Wilson is 23. She studies law in Toronto.", "Emma Wilson", 23, "Toronto"),
    ("Born 38 years ago, Ahmed Hassan now teaches maths in Cairo.", "Ahmed Hassan", 38, "Cairo"),
    ("Sofia Rossi, 29, opened a small gallery in Florence.", "Sofia Rossi", 29, "Florence"),
    ("In Dublin, 71-year-old Patrick Byrne still plays the fiddle every night.",
     "Patrick Byrne", 71, "Dublin"),
    ("Lena Novak is a 36-year-old pilot based in Prague.", "Lena Novak", 36, "Prague"),
    ("Kim Min-jun, who is 31, writes software in Seoul.", "Kim Min-jun", 31, "Seoul"),
    ("The winner, Olivia Brown (58), is a retired judge from Sydney.", "Olivia Brown", 58, "Sydney"),
    ("Diego Ramirez lives in Mexico City and is 26 years old.", "Diego Ramirez", 26, "Mexico City"),
    ("Hannah Schmidt, aged 47, manages a hotel in Vienna.", "Hannah Schmidt", 47, "Vienna"),
    ("Noah Johnson is a 12-year-old chess prodigy from Boston.", "Noah Johnson", 12, "Boston"),
    ("Fatima Zahra, 33, sells spices at the market in Marrakesh.", "Fatima Zahra", 33, "Marrakesh"),
    ("Erik Larsen turned 60 last week at his home in Oslo.", "Erik Larsen", 60, "Oslo"),
)
EXTRACT_ASK = ('Extract the person\'s name, age and city from this text as JSON with the keys '
               '"name", "age" and "city": {}')


def chat(tokenizer, message: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def decode_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` distinct short chat prompts (up to 256)."""
    pairs = [(ask, topic) for ask in ASKS for topic in TOPICS][:count]
    return [chat(tokenizer, ask.format(topic)) for ask, topic in pairs]


# --------------------------------------------------------------------------- 1. decode


@dataclass
class DecodeRun:
    batch: int
    steps: int
    """Steps where all ``batch`` requests decoded (each gives one token per request)."""
    seconds: float
    other_cores: float
    full_length: bool
    """Every request produced its max_tokens (none stopped early)."""

    @property
    def tokens_per_second(self) -> float:
        return self.batch * self.steps / self.seconds

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / self.steps

    def __add__(self, other: DecodeRun) -> DecodeRun:
        seconds = self.seconds + other.seconds
        noise = (self.other_cores * self.seconds + other.other_cores * other.seconds) / seconds
        return DecodeRun(self.batch, self.steps + other.steps, seconds, noise,
                         self.full_length and other.full_length)


_request_ids = itertools.count()


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def decode_params(max_tokens: int, constrained: bool) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          structured_outputs=DECODE_CONSTRAINT if constrained else None)


def all_decoding(llm: LLM, batch: int) -> bool:
    """The next step decodes one token for each of ``batch`` requests and nothing else."""
    scheduler = llm.engine.core.scheduler
    running = scheduler.running
    return (scheduler.num_waiting == 0 and len(running) == batch
            and all(r.num_tokens - r.num_computed_tokens == 1 for r in running))


def run_decode(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> DecodeRun:
    """Run the batch to the end, timing each step where every request decodes."""
    engine = llm.engine
    ids = [f"decode-{next(_request_ids)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    busy, own, wall = cpu_busy_seconds(), own_cpu_seconds(), time.perf_counter()
    steps, seconds, finished = 0, 0.0, {}
    while engine.has_unfinished_requests():
        decoding = all_decoding(llm, len(prompts))
        start = time.perf_counter()
        finished.update((out.request_id, out) for out in engine.step())
        if decoding:
            steps += 1
            seconds += time.perf_counter() - start
    wall = time.perf_counter() - wall
    other = (cpu_busy_seconds() - busy - (own_cpu_seconds() - own)) / wall
    full = all(len(finished[i].outputs[0].token_ids) == params.max_tokens for i in ids)
    return DecodeRun(len(prompts), steps, seconds, max(other, 0.0), full)


def measure_decode(llm: LLM, prompts: list[list[int]], sizes: Sizes) -> dict[str, DecodeRun]:
    """Plain and constrained runs of one batch, alternated (after a warm-up that also
    leaves the prompts in the prefix cache)."""
    for constrained in (False, True):
        run_decode(llm, prompts, decode_params(3, constrained))
    wait_until_quiet(sizes.quiet_wait_s)
    runs: dict[str, list[DecodeRun]] = {"plain": [], "json": []}
    for round_ in range(sizes.rounds):
        order = ("plain", "json") if round_ % 2 == 0 else ("json", "plain")
        for arm in order:
            params = decode_params(sizes.decode_tokens, arm == "json")
            runs[arm].append(run_decode(llm, prompts, params))
    merged = {arm: sum(arm_runs[1:], arm_runs[0]) for arm, arm_runs in runs.items()}
    print(f"  B={len(prompts)}: plain {merged['plain'].tokens_per_second:.1f} tok/s, "
          f"json {merged['json'].tokens_per_second:.1f} tok/s "
          f"({merged['json'].tokens_per_second / merged['plain'].tokens_per_second:.3f}x, "
          f"other processes {merged['plain'].other_cores:.2f}/{merged['json'].other_cores:.2f} "
          f"cores)", flush=True)
    return merged


# --------------------------------------------------------------------------- 1b. mask cost


@dataclass
class MaskCost:
    batch: int
    fill_ms: float
    apply_ms: float

    @property
    def total_ms(self) -> float:
        return self.fill_ms + self.apply_ms


def valid_prefix(tokenizer, row: int, min_tokens: int) -> list[int]:
    """Tokens of a JSON text the decode schema accepts (unfinished), at least ``min_tokens``."""
    topic = TOPICS[row % len(TOPICS)]
    items = [f"fact {k} about {topic}: it is worth a closer look" for k in range(40)]
    tokens = tokenizer.encode('{"items":["' + '","'.join(items), add_special_tokens=False)
    if len(tokens) < min_tokens:
        raise SystemExit(f"the mask benchmark's text is {len(tokens)} tokens, {min_tokens} needed")
    return tokens


def measure_mask(compiler: GrammarCompiler, tokenizer, batch: int, steps: int) -> MaskCost:
    """Per step: the B rows' masks filled on llguidance's pool, then applied to [B, V] logits;
    every matcher then consumes its row's next token (rows start at different offsets)."""
    params = StructuredOutputsParams(**DECODE_CONSTRAINT)
    rows: list[tuple[llguidance.LLMatcher, list[int]]] = []
    for row in range(batch):
        offset = 2 + row % 29
        tokens = valid_prefix(tokenizer, row, offset + steps + 1)
        matcher = compiler.matcher(params)
        if not matcher.consume_tokens(tokens[:offset]) or matcher.is_error():
            raise SystemExit(f"the decode schema refused its own text: {matcher.get_error()}")
        rows.append((matcher, tokens[offset:]))
    executor = llguidance.LLExecutor()
    bitmask = llguidance.torch.allocate_token_bitmask(batch, compiler.vocab_size)
    logits = torch.randn(batch, compiler.vocab_size)
    sampling = SamplingParams(temperature=0)
    work = [(matcher, i) for i, (matcher, _) in enumerate(rows)]
    fill_s: list[float] = []
    apply_s: list[float] = []
    for step in range(steps + 1):  # step 0 is a warm-up
        step_logits = logits.clone()
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(executor, work, bitmask)
        filled = time.perf_counter()
        sampling_rows = [SamplingRow(sampling, (), (), frozenset(), grammar_mask=bitmask[i])
                         for i in range(batch)]
        # In place, as the runner's sampler does when no row returns logprobs.
        masked = apply_token_constraints(step_logits, sampling_rows, copy=False)
        applied = time.perf_counter()
        if step:
            fill_s.append(filled - start)
            apply_s.append(applied - filled)
        if not torch.isfinite(masked).any(dim=1).all():
            raise SystemExit("a row's mask allows no token")
        for matcher, tokens in rows:
            matcher.consume_token(tokens[step])
    return MaskCost(batch, 1000 * statistics.median(fill_s), 1000 * statistics.median(apply_s))


# --------------------------------------------------------------------------- 2. compile


@dataclass
class CompileTime:
    cold_ms: float
    cached_ms: float
    first_mask_ms: float


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure_compile(compiler: GrammarCompiler, make: Callable[[str], dict],
                    trials: int, prefix: str) -> CompileTime:
    """Medians over ``trials`` grammars the compiler has not seen (tags ``prefix0``, ...)."""
    cold, cached, first_mask = [], [], []
    bitmask = llguidance.torch.allocate_token_bitmask(1, compiler.vocab_size)
    for trial in range(trials):
        params = StructuredOutputsParams(**make(f"{prefix}{trial}"))
        start = time.perf_counter()
        matcher = compiler.matcher(params)
        compiled = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        masked = time.perf_counter()
        compiler.matcher(params)
        cold.append(compiled - start)
        first_mask.append(masked - compiled)
        cached.append(time.perf_counter() - masked)
    return CompileTime(*(1000 * statistics.median(v) for v in (cold, cached, first_mask)))


# --------------------------------------------------------------------------- 3. TTFT


@dataclass
class Ttft:
    plain_s: float
    warm_s: float
    cold_s: float


def measure_ttft(llm: LLM, trials: int, quiet_wait_s: float) -> Ttft:
    """Medians of max_tokens=1 calls, one prompt of its own each, interleaved."""
    tokenizer, counter = llm.get_tokenizer(), itertools.count()

    def call(schema: dict | None) -> float:
        prompt = chat(tokenizer, f"Customer file {next(counter)}: make up a complete record for "
                                 "this customer, as JSON with every field filled in.")
        params = SamplingParams(temperature=0, max_tokens=1, structured_outputs=None
                                if schema is None else {"json": schema})
        return timed(lambda: llm.generate([prompt], params))[0]

    call(None), call(large_schema())  # warm-up: the warm schema is now known
    wait_until_quiet(quiet_wait_s)
    times: dict[str, list[float]] = {"plain": [], "warm": [], "cold": []}
    arms: dict[str, Callable[[int], dict | None]] = {
        "plain": lambda _: None, "warm": lambda _: large_schema(),
        "cold": lambda trial: large_schema(f"_ttft{trial}")}
    for trial in range(trials):
        names = list(arms)[trial % 3:] + list(arms)[:trial % 3]
        for name in names:
            times[name].append(call(arms[name](trial)))
    return Ttft(*(statistics.median(times[k]) for k in ("plain", "warm", "cold")))


# --------------------------------------------------------------------------- 4. extraction


@dataclass
class Extraction:
    valid: int
    """Answers that parse as a whole and validate."""
    embedded: int
    """Answers whose first JSON object validates, whatever text surrounds it."""
    correct: int
    """Valid answers with all three values right."""
    total: int
    mean_tokens: float
    example: str
    """The first answer, for a look."""


def parse_answer(text: str) -> object:
    """The answer as JSON (the inside of a ``` fence if there is one); None if it is not."""
    fenced = re.search(r"```(?:json)?\s*(.*?)(```|$)", text, re.DOTALL)
    try:
        return json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return None


def first_object(text: str) -> object:
    """The first JSON object in the text, whatever surrounds it; None if there is none."""
    start = text.find("{")
    try:
        return json.JSONDecoder().raw_decode(text[start:])[0] if start != -1 else None
    except ValueError:
        return None


def measure_extraction(llm: LLM, people: int, max_tokens: int, constrained: bool) -> Extraction:
    tokenizer = llm.get_tokenizer()
    cases = PEOPLE[:people]
    prompts = [chat(tokenizer, EXTRACT_ASK.format(text)) for text, *_ in cases]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=
                            {"json": PERSON_SCHEMA} if constrained else None)
    outputs = llm.generate(prompts, params)
    validator = jsonschema.Draft202012Validator(PERSON_SCHEMA)
    valid = embedded = correct = 0
    for output, (_, name, age, city) in zip(outputs, cases):
        text = output.outputs[0].text
        embedded += validator.is_valid(first_object(text))
        answer = parse_answer(text)
        if validator.is_valid(answer):
            valid += 1
            correct += answer == {"name": name, "age": age, "city": city}
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs) / len(outputs)
    return Extraction(valid, embedded, correct, len(cases), tokens, outputs[0].outputs[0].text)


# --------------------------------------------------------------------------- report


def decode_table(decode: dict[int, dict[str, DecodeRun]], masks: dict[int, MaskCost]) -> str:
    rows = ["| batch | plain (tok/s) | JSON schema (tok/s) | ratio | plain step (ms) | "
            "mask fill (ms) | mask apply (ms) | fill + apply, share of a plain step | "
            "other processes (cores) |", "|---" * 9 + "|"]
    for batch, runs in decode.items():
        plain, constrained, mask = runs["plain"], runs["json"], masks[batch]
        ratio = constrained.tokens_per_second / plain.tokens_per_second
        rows.append(f"| {batch} | {plain.tokens_per_second:.1f} | {constrained.tokens_per_second:.1f}"
                    f" | {ratio:.3f}x | {plain.step_ms:.1f} | {mask.fill_ms:.2f} | "
                    f"{mask.apply_ms:.2f} | {mask.total_ms / plain.step_ms:.1%} | "
                    f"{plain.other_cores:.2f} / {constrained.other_cores:.2f} |")
    return "\n".join(rows)


def compile_table(compiles: dict[str, CompileTime]) -> str:
    rows = ["| grammar | cold compile (ms) | cached: deep copy (ms) | first mask after cold (ms) |",
            "|---|---|---|---|"]
    rows += [f"| {name} | {c.cold_ms:.2f} | {c.cached_ms:.3f} | {c.first_mask_ms:.2f} |"
             for name, c in compiles.items()]
    return "\n".join(rows)


def ttft_table(ttft: Ttft) -> str:
    return "\n".join([
        "| request | TTFT (ms) | ratio to unconstrained |", "|---|---|---|",
        f"| unconstrained | {1000 * ttft.plain_s:.1f} | 1.00x |",
        f"| large schema, warm (seen before) | {1000 * ttft.warm_s:.1f} | "
        f"{ttft.warm_s / ttft.plain_s:.2f}x |",
        f"| large schema, cold (new to the engine) | {1000 * ttft.cold_s:.1f} | "
        f"{ttft.cold_s / ttft.plain_s:.2f}x |"])


def extraction_table(extractions: dict[str, Extraction]) -> str:
    rows = ["| answers | parse and validate | first JSON object in it validates | "
            "valid, all three values right | output tokens (mean) |", "|---|---|---|---|---|"]
    rows += [f"| {name} | {e.valid}/{e.total} ({e.valid / e.total:.0%}) | {e.embedded}/{e.total} | "
             f"{e.correct}/{e.total} | {e.mean_tokens:.1f} |" for name, e in extractions.items()]
    return "\n".join(rows)


def findings(decode: dict[int, dict[str, DecodeRun]], masks: dict[int, MaskCost],
             compiles: dict[str, CompileTime], ttft: Ttft,
             extractions: dict[str, Extraction]) -> list[str]:
    """Facts the figures show, one line each."""
    ratios = {b: r["json"].tokens_per_second / r["plain"].tokens_per_second
              for b, r in decode.items()}
    worst = min(ratios, key=ratios.get)
    shares = {b: masks[b].total_ms / decode[b]["plain"].step_ms for b in decode}
    constrained, free = extractions["JSON schema as a constraint"], extractions["asked in the prompt"]
    lines = [f"Decode under the schema runs at {min(ratios.values()):.2f}-{max(ratios.values()):.2f}x "
             f"of plain (lowest at batch {worst}); the mask alone is "
             f"{min(shares.values()):.1%}-{max(shares.values()):.1%} of a plain step.",
             f"Compiling a grammar takes {min(c.cold_ms for c in compiles.values()):.1f}-"
             f"{max(c.cold_ms for c in compiles.values()):.1f} ms cold, "
             f"{max(c.cached_ms for c in compiles.values()):.2f} ms at most from the cache.",
             f"TTFT with the large schema is {ttft.cold_s / ttft.plain_s:.2f}x of unconstrained "
             f"when the schema is new to the engine, {ttft.warm_s / ttft.plain_s:.2f}x when cached.",
             f"Extraction: {constrained.valid}/{constrained.total} valid answers with the "
             f"constraint, {free.valid}/{free.total} without ({free.embedded}/{free.total} "
             "without hold a valid object somewhere in the text)."]
    if not all(r["json"].full_length and r["plain"].full_length for r in decode.values()):
        lines.append("Some decode requests stopped before max_tokens: the window was not full.")
    return [f"- {line}" for line in lines]


def report(sizes: Sizes, vocab_size: int, decode: dict[int, dict[str, DecodeRun]],
           masks: dict[int, MaskCost], compiles: dict[str, CompileTime], ttft: Ttft,
           extractions: dict[str, Extraction]) -> str:
    return f"""## Structured outputs (benchmarks/bench_structured.py)

SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32) on the CPU, llguidance
{version("llguidance")}. Every figure has its unconstrained baseline from the same run.

Decode: B short chat requests, greedy, ignore_eos, {sizes.decode_tokens} tokens each, under a
JSON schema (an object with an array of 200+ strings of 20+ characters, no whitespace: never
complete within the window) vs unconstrained; tokens/s over the steps where all B requests
decode, {sizes.rounds} run(s) per arm, alternated. Mask: B llguidance matchers in different
states, `fill_next_token_bitmask_par` on an `LLExecutor` (in the engine it overlaps the forward
pass) and `apply_token_constraints` in place on [B, {vocab_size}] float32 logits, without the model
(median over {sizes.mask_steps} steps, every matcher advancing a token a step).

{decode_table(decode, masks)}

Other processes: what they used of the {os.cpu_count()} cores during the plain / constrained
runs; a run beside more than ~0.2 busy cores is not reliable.

Compile (`GrammarCompiler.matcher`): cold is the median over {sizes.compile_trials} grammars
new to the compiler (one property name or literal varied), cached the same grammar again.

{compile_table(compiles)}

Time to first token (`LLM.generate`, max_tokens=1, a prompt of its own each call, median of
{sizes.ttft_trials}): a cold schema is compiled twice, by the front end's check and by the
engine core.

{ttft_table(ttft)}

Extraction: {extractions["asked in the prompt"].total} chat prompts asking for a person's name,
age and city as JSON (schema: name string, age integer, city string, all required, no other
keys), greedy, at most {sizes.extract_tokens} tokens; valid = the whole answer parses (a ```json
fence stripped) and validates with jsonschema.

{extraction_table(extractions)}

What it says:

{chr(10).join(findings(decode, masks, compiles, ttft, extractions))}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for a quick check")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    started = time.perf_counter()

    llm = LLM(MODEL, progress=False, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
              kv_cache_memory=KV_CACHE_MEMORY)
    tokenizer, model = llm.get_tokenizer(), llm.engine.config.model
    compiler = GrammarCompiler(tokenizer, model.vocab_size, list(model.eos_token_ids))
    print(f"model ready in {time.perf_counter() - started:.0f} s; {os.cpu_count()} cores", flush=True)

    print("decode, plain vs JSON schema:", flush=True)
    prompts = decode_prompts(tokenizer, max(sizes.batch_sizes))
    decode = {b: measure_decode(llm, prompts[:b], sizes) for b in sizes.batch_sizes}
    masks = {b: measure_mask(compiler, tokenizer, b, sizes.mask_steps) for b in sizes.batch_sizes}
    for mask in masks.values():
        print(f"  mask B={mask.batch}: fill {mask.fill_ms:.2f} ms, apply {mask.apply_ms:.2f} ms",
              flush=True)

    compiler.matcher(StructuredOutputsParams(json=small_schema("_warmup")))
    wait_until_quiet(sizes.quiet_wait_s)
    compiles = {name: measure_compile(compiler, make, sizes.compile_trials, f"_c{i}_")
                for i, (name, make) in enumerate(GRAMMARS.items())}
    for name, c in compiles.items():
        print(f"  compile {name}: cold {c.cold_ms:.2f} ms, cached {c.cached_ms:.3f} ms, "
              f"first mask {c.first_mask_ms:.2f} ms", flush=True)

    ttft = measure_ttft(llm, sizes.ttft_trials, sizes.quiet_wait_s)
    print(f"  TTFT: plain {1000 * ttft.plain_s:.1f} ms, warm {1000 * ttft.warm_s:.1f} ms, "
          f"cold {1000 * ttft.cold_s:.1f} ms", flush=True)

    extractions = {name: measure_extraction(llm, sizes.people, sizes.extract_tokens, constrained)
                   for name, constrained in (("asked in the prompt", False),
                                             ("JSON schema as a constraint", True))}
    for name, e in extractions.items():
        print(f"  extraction, {name}: {e.valid}/{e.total} valid; first answer {e.example!r}",
              flush=True)
    body = report(sizes, model.vocab_size, decode, masks, compiles, ttft, extractions)
    print(body)
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_structured", body)


if __name__ == "__main__":
    main()
