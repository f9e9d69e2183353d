"""The model runner: the one place where lists of ids become tensors.

Each step it applies the scheduler's diff to its own copy of the requests, packs the
scheduled tokens into one flat batch (decodes first), runs the model, and samples a
token for every request whose scheduled tokens reached its end.

With speculative decoding a request's scheduled tokens may be its last sampled token
followed by drafts: the rows of all of them are verified (sample/rejection.py) and the
request gains the accepted drafts plus one token. Then the drafter proposes the next
step's drafts for every request that sampled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from openinfer.attention.base import AttentionBackend, AttentionMetadata
from openinfer.distributed.context_parallel import get_cp, plan_step
from openinfer.engine.outputs import (
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from openinfer.kv.spec import FullAttentionSpec, LayerGroup
from openinfer.sample.logprobs import compute_logprobs
from openinfer.sample.rejection import VerifyRequest, verify
from openinfer.sample.rows import SamplingRow
from openinfer.sample.sampler import Sampler
from openinfer.sampling_params import SamplingParams
from openinfer.spec.draft_model import ModelDrafter, StepBatch
from openinfer.spec.proposer import TokenProposer
from openinfer.worker.decode_graphs import DecodeGraphs
from openinfer.worker.kv_cache import per_layer_views


@dataclass
class RunnerRequest:
    request_id: str
    token_ids: list[int]
    """Prompt followed by the tokens sampled so far."""
    num_prompt_tokens: int
    params: SamplingParams
    stop_token_ids: frozenset[int]
    block_ids: list[list[int]]
    num_computed_tokens: int
    draft_probs: torch.Tensor | None = None
    """A model drafter's distributions [k, V] for the drafts it proposed last."""

    @staticmethod
    def from_new(data: NewRequestData) -> RunnerRequest:
        return RunnerRequest(
            request_id=data.request_id,
            token_ids=[*data.prompt_token_ids, *data.output_token_ids],
            num_prompt_tokens=len(data.prompt_token_ids),
            params=data.sampling_params,
            stop_token_ids=data.stop_token_ids,
            block_ids=[list(t) for t in data.block_ids],
            num_computed_tokens=data.num_computed_tokens,
        )


@dataclass
class _ForwardStep:
    """A step whose forward pass ran and whose tokens are not sampled yet."""

    sched: SchedulerOutput
    batch: StepBatch


class ModelRunner:
    """Turns the scheduler's diff into the step's tensors, runs the model and samples.

    ``kv_caches`` holds one tensor per layer group (worker/kv_cache.py); each step builds
    one attention metadata per group (its block tables) and hands every layer its
    group's."""

    def __init__(self, model: nn.Module, groups: list[LayerGroup], kv_caches: list[torch.Tensor],
                 num_layers: int, device: torch.device | str, attention: AttentionBackend,
                 seed: int | None = None, proposer: TokenProposer | None = None,
                 num_speculative_tokens: int = 0, drafter: ModelDrafter | None = None) -> None:
        self.model = model
        self.attention = attention
        self.device = torch.device(device)
        self.groups = groups
        self.block_size = groups[0].spec.block_size
        self.kv_caches = kv_caches
        self.layer_caches = per_layer_views(groups, kv_caches, num_layers)
        self.layer_group = [0] * num_layers
        for g, group in enumerate(groups):
            for layer in group.layers:
                self.layer_group[layer] = g
        self.sampler = Sampler(seed)
        self.requests: dict[str, RunnerRequest] = {}
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.drafter = drafter
        """A model drafter (its layers follow the target's in ``layer_caches``)."""
        self._step: _ForwardStep | None = None
        self.decode_graphs: DecodeGraphs | None = None
        """CUDA graphs for decode-only steps (worker/decode_graphs.py), set by the worker."""
        self.cp = get_cp()
        """Prefill context parallelism: this rank's place (size 1: off)."""
        if self.cp.size > 1 and (len(groups) != 1 or not isinstance(groups[0].spec,
                                                                    FullAttentionSpec)):
            raise ValueError("prefill context parallelism needs a model whose every layer "
                             "is full attention (one KV group; no sliding windows)")

    def _apply_diff(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids:
            self.requests.pop(request_id, None)
            if self.proposer is not None:
                self.proposer.drop(request_id)
        for data in sched.new_requests:
            self.requests[data.request_id] = RunnerRequest.from_new(data)
        for data in sched.cached_requests:
            req = self.requests[data.request_id]
            if data.num_kept_blocks is not None:
                for table, keep in zip(req.block_ids, data.num_kept_blocks):
                    del table[keep:]
            for table, new_blocks in zip(req.block_ids, data.new_block_ids):
                table.extend(new_blocks)
            req.num_computed_tokens = data.num_computed_tokens

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> None:
        """The step's forward pass; ``sample`` then takes the tokens (between the two the
        engine core may finish the step's grammar masks)."""
        self._apply_diff(sched)
        self._step = None
        if sched.is_empty:
            return
        counts = sched.num_scheduled_tokens
        # Decodes (one query token) first: attention batches them together.
        order = sorted(counts, key=lambda rid: counts[rid] != 1)
        batch = [self.requests[rid] for rid in order]

        drafts = sched.spec_token_ids
        input_ids: list[int] = []
        positions: list[int] = []
        for req in batch:
            start, end = req.num_computed_tokens, req.num_computed_tokens + counts[req.request_id]
            draft = drafts.get(req.request_id)
            if draft:  # the last sampled token, then the drafts
                input_ids.append(req.token_ids[start])
                input_ids.extend(draft)
            else:
                input_ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
        query_lens = [counts[r.request_id] for r in batch]
        seq_lens = [r.num_computed_tokens + counts[r.request_id] for r in batch]
        input_ids_t, positions_t = self.long_tensor(input_ids), self.long_tensor(positions)
        if self.cp.size > 1:
            hidden, metas = self._forward_context_parallel(batch, query_lens, seq_lens,
                                                           input_ids_t, positions_t)
        else:
            group_metas = [self.attention.build_metadata(
                query_lens=query_lens, seq_lens=seq_lens,
                block_tables=[r.block_ids[g] for r in batch],
                block_size=self.block_size, device=self.device) for g in range(len(self.groups))]
            ends = [-1 if r.params.prompt_logprobs is not None else len(r.token_ids) for r in batch]
            for meta in group_metas:
                meta.prefill_ends = ends
            metas = [group_metas[g] for g in self.layer_group]
            graph_size = self._graph_size(query_lens, drafts, group_metas)
            if graph_size is not None:
                hidden = self.decode_graphs.run(graph_size, input_ids_t, positions_t, group_metas)
            else:
                hidden = self.model(input_ids_t, positions_t, self.layer_caches, metas)
        self._step = _ForwardStep(sched, StepBatch(
            batch, query_lens, [r.num_computed_tokens for r in batch], input_ids_t,
            positions_t, metas, hidden))

    def _graph_size(self, query_lens: list[int], drafts: dict[str, list[int]],
                    group_metas: list[AttentionMetadata]) -> int | None:
        """The decode graph a step replays: only a step of plain decodes (one token each,
        nothing to verify); None runs it eagerly."""
        if self.decode_graphs is None or drafts or any(n != 1 for n in query_lens):
            return None
        return self.decode_graphs.size_for(len(query_lens), group_metas)

    def _forward_context_parallel(self, batch: list[RunnerRequest], query_lens: list[int],
                                  seq_lens: list[int], input_ids: torch.Tensor,
                                  positions: torch.Tensor,
                                  ) -> tuple[torch.Tensor, list[AttentionMetadata]]:
        """This rank's share of the step (openinfer/distributed/context_parallel.py), and
        the whole step's hidden states assembled from every rank's."""
        split, q_lens, s_lens, tables = plan_step(
            self.cp, query_lens, seq_lens, [r.block_ids[0] for r in batch], self.block_size)
        meta = self.attention.build_metadata(query_lens=q_lens, seq_lens=s_lens,
                                             block_tables=tables, block_size=self.block_size,
                                             device=self.device)
        meta.context_parallel = split
        metas = [meta] * len(self.layer_group)
        rows = split.local_rows.to(self.device)
        hidden = self.model(input_ids[rows], positions[rows], self.layer_caches, metas)
        return split.assemble_hidden(hidden), metas

    @torch.inference_mode()
    def sample(self, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Tokens for the forward pass ``execute`` ran (under the step's grammar masks),
        then the drafts for the next step."""
        out = ModelRunnerOutput()
        if self._step is None:
            return out
        sched, step = self._step.sched, self._step.batch
        self._step = None
        batch, counts, drafts = step.requests, sched.num_scheduled_tokens, sched.spec_token_ids
        self._prompt_logprobs(batch, counts, step.hidden, out)
        sampled = self._sample(batch, counts, drafts, step.hidden, grammar, out)
        for req in batch:
            num_drafts = len(drafts.get(req.request_id, ()))
            num_rejected = num_drafts + 1 - len(out.sampled_token_ids[req.request_id]) if num_drafts else 0
            req.num_computed_tokens += counts[req.request_id] - num_rejected
        start = time.perf_counter()
        if self.proposer is not None:
            for req in sampled:
                out.drafts[req.request_id] = self.proposer.propose(
                    req.request_id, req.token_ids, req.num_prompt_tokens,
                    self.num_speculative_tokens)
        if self.drafter is not None:
            out.drafts.update(self.drafter.propose(self, step, sampled, sched.draft_budget))
        # (A model drafter's picks come back as Python ints: its device work is done.)
        out.draft_seconds = time.perf_counter() - start
        return out

    def _sample(self, batch: list[RunnerRequest], counts: dict[str, int],
                drafts: dict[str, list[int]], hidden: torch.Tensor,
                grammar: GrammarBitmask | None, out: ModelRunnerOutput) -> list[RunnerRequest]:
        """Sample (or verify drafts and sample) for every request whose scheduled tokens
        reach its end; returns those requests."""
        rows: list[SamplingRow] = []
        last_positions: list[int] = []
        sampling: list[RunnerRequest] = []
        verifying: list[VerifyRequest] = []
        offset = 0
        for req in batch:
            n = counts[req.request_id]
            draft = drafts.get(req.request_id, [])
            if req.num_computed_tokens + n - len(draft) == len(req.token_ids):
                sampling.append(req)
                output = req.token_ids[req.num_prompt_tokens:]
                prompt = req.token_ids[:req.num_prompt_tokens]
                first_mask = grammar.rows.get(req.request_id) if grammar is not None else None
                req_rows = [SamplingRow(params=req.params, prompt_token_ids=prompt,
                                        output_token_ids=output + draft[:j],
                                        stop_token_ids=req.stop_token_ids,
                                        grammar_mask=None if first_mask is None
                                        else grammar.bitmask[first_mask + j])
                            for j in range(len(draft) + 1)]
                last_positions.extend(range(offset + n - 1 - len(draft), offset + n))
                rows.extend(req_rows)
                probs = req.draft_probs[:len(draft)] if req.draft_probs is not None else None
                verifying.append(VerifyRequest(req_rows, draft, probs))
            offset += n
        if not rows:
            return sampling
        logits = self.model.compute_logits(hidden[self.long_tensor(last_positions)])
        if not drafts:
            result = self.sampler(logits, rows, in_place=True)
            for req, token, logprobs in zip(sampling, result.token_ids, result.logprobs):
                req.token_ids.append(token)
                out.sampled_token_ids[req.request_id] = [token]
                if logprobs is not None:
                    out.logprobs[req.request_id] = [logprobs]
            return sampling
        for req, result in zip(sampling, verify(self.sampler, logits, verifying, in_place=True)):
            req.token_ids.extend(result.token_ids)
            out.sampled_token_ids[req.request_id] = result.token_ids
            if result.logprobs is not None:
                out.logprobs[req.request_id] = result.logprobs
        return sampling

    def _prompt_logprobs(self, batch: list[RunnerRequest], counts: dict[str, int],
                         hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Logprob of each prompt token given the tokens before it, for requests asking.

        The hidden state at position j predicts token j + 1, so a chunk covering
        positions [start, end) yields prompt positions start+1 .. min(end, prompt_len-1).
        """
        offset = 0
        for req in batch:
            n = counts[req.request_id]
            start = req.num_computed_tokens
            stop = min(start + n, req.num_prompt_tokens - 1)
            if req.params.prompt_logprobs is not None and start < stop:
                rows = self.long_tensor(list(range(offset, offset + stop - start)))
                logits = self.model.compute_logits(hidden[rows])
                targets = req.token_ids[start + 1:stop + 1]
                entries = compute_logprobs(logits, targets, req.params.prompt_logprobs)
                out.prompt_logprobs[req.request_id] = (start + 1, entries)
            offset += n

    @torch.inference_mode()
    def profile_step_seconds(self, rows: list[int], query_len: int,
                             repeats: int = 4) -> list[tuple[int, float]]:
        """Fastest seconds of a model step (forward and logits of every row) at each
        number of rows, as sequences of ``query_len`` rows from position 0 written into
        the first blocks (call before any request holds blocks). Stops at the rows the
        cache has blocks for."""
        blocks_per_seq = -(-query_len // self.block_size)
        num_blocks = self.kv_caches[0].shape[0]
        points = []
        for num_rows in rows:
            lens = [query_len] * (num_rows // query_len) + (
                [num_rows % query_len] if num_rows % query_len else [])
            if len(lens) * blocks_per_seq * len(self.groups) > num_blocks:
                break
            tables = [[s * blocks_per_seq + b for b in range(blocks_per_seq)]
                      for s in range(len(lens))]
            metas_by_group = [self.attention.build_metadata(
                query_lens=lens, seq_lens=lens, block_tables=[
                    [len(self.groups) * t + g for t in table] for table in tables],
                block_size=self.block_size, device=self.device) for g in range(len(self.groups))]
            metas = [metas_by_group[g] for g in self.layer_group]
            input_ids = self.long_tensor([1] * num_rows)
            positions = self.long_tensor([p for n in lens for p in range(n)])
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                hidden = self.model(input_ids, positions, self.layer_caches, metas)
                self.model.compute_logits(hidden)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            points.append((num_rows, min(times[1:])))  # noise only ever adds time
        for cache in self.kv_caches:  # what was written is garbage: leave zeros, as allocated
            cache.zero_()
        return points

    def long_tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
