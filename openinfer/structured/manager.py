"""The engine core's side of structured outputs: a grammar per constrained request, and each
step's token masks computed while the model runs.

    step:  schedule -> submit(masks) -> forward pass | masks on llguidance's threads
                                     -> sample(masks) -> update_from_output (matchers advance)

A request that samples this step gets one mask row per row it samples from: its next token,
and with speculative decoding one more after each draft (computed by advancing the matcher
over the drafts and rolling it back). The masks depend only on tokens already accepted, so
they are ready before the forward pass ends; the matchers advance after sampling, when the
scheduler appends the step's tokens.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from openinfer.engine.outputs import GrammarBitmask, SchedulerOutput
from openinfer.engine.request import Request
from openinfer.structured.grammar import GrammarCompiler, RequestGrammar
from openinfer.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int, num_threads: int | None = None) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids, cache_size)
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor(num_threads)
        # One thread that waits on llguidance's own pool (which runs without the GIL).
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(self.compiler.matcher(params), params.start_after_token_ids)

    def submit(self, scheduled: SchedulerOutput,
               requests: dict[str, Request]) -> Future[GrammarBitmask] | None:
        """Start computing the masks of the step's sampling rows; None when no request
        sampling this step is constrained."""
        work: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        rows: dict[str, int] = {}
        num_rows = 0
        for request_id, n in scheduled.num_scheduled_tokens.items():
            req = requests.get(request_id)
            # (Gone: ended by the step before, which landed after this one was scheduled.)
            if req is None or req.grammar is None or not req.grammar.active:
                continue
            drafts = scheduled.spec_token_ids.get(request_id, [])
            if req.num_computed_tokens + n - len(drafts) != req.num_tokens:
                continue  # a prompt chunk that does not reach the end: nothing sampled
            rows[request_id] = num_rows
            work.append((req.grammar.matcher, num_rows, list(drafts)))
            num_rows += 1 + len(drafts)
        if not work:
            return None
        # Imported here: llguidance.torch pulls in torch._dynamo (~4 s of every process start).
        import llguidance.torch

        bitmask = llguidance.torch.allocate_token_bitmask(num_rows, self.vocab_size)
        executor = self._executor

        plain = [(matcher, row) for matcher, row, drafts in work if not drafts]
        drafted = [item for item in work if item[2]]

        def fill() -> GrammarBitmask:
            if plain:
                llguidance.torch.fill_next_token_bitmask_par(executor, plain, bitmask)
            if drafted:  # one row per draft too (the matcher advances, then rolls back)
                llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(
                    executor, drafted, bitmask)
            return GrammarBitmask(rows, bitmask)

        return self._thread.submit(fill)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
