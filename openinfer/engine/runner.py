"""The model runner: the one place where lists of ids become tensors.

Each step it applies the scheduler's diff to its own copy of the requests, packs the
scheduled tokens into one flat batch (decodes first), runs the model, and samples a
token for every request whose scheduled tokens reached its end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from openinfer.attention.backend import AttentionBackend
from openinfer.engine.kv_cache import per_layer_views
from openinfer.engine.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from openinfer.kv.spec import LayerGroup
from openinfer.layers.sampler import Sampler, SamplingRow, compute_logprobs
from openinfer.sampling_params import SamplingParams


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


class ModelRunner:
    """Turns the scheduler's diff into the step's tensors, runs the model and samples.

    ``kv_caches`` holds one tensor per layer group (engine/kv_cache.py); each step builds
    one attention metadata per group (its block tables) and hands every layer its
    group's."""

    def __init__(self, model: nn.Module, groups: list[LayerGroup], kv_caches: list[torch.Tensor],
                 num_layers: int, device: torch.device | str, attention: AttentionBackend,
                 seed: int | None = None) -> None:
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

    def _apply_diff(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids:
            self.requests.pop(request_id, None)
        for data in sched.new_requests:
            self.requests[data.request_id] = RunnerRequest.from_new(data)
        for data in sched.cached_requests:
            req = self.requests[data.request_id]
            for table, new_blocks in zip(req.block_ids, data.new_block_ids):
                table.extend(new_blocks)
            req.num_computed_tokens = data.num_computed_tokens

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diff(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        counts = sched.num_scheduled_tokens
        # Decodes (one query token) first: attention batches them together.
        order = sorted(counts, key=lambda rid: counts[rid] != 1)
        batch = [self.requests[rid] for rid in order]

        input_ids: list[int] = []
        positions: list[int] = []
        for req in batch:
            start, end = req.num_computed_tokens, req.num_computed_tokens + counts[req.request_id]
            input_ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
        query_lens = [counts[r.request_id] for r in batch]
        seq_lens = [r.num_computed_tokens + counts[r.request_id] for r in batch]
        group_metas = [self.attention.build_metadata(
            query_lens=query_lens, seq_lens=seq_lens,
            block_tables=[r.block_ids[g] for r in batch],
            block_size=self.block_size, device=self.device) for g in range(len(self.groups))]
        metas = [group_metas[g] for g in self.layer_group]
        hidden = self.model(self._long(input_ids), self._long(positions), self.layer_caches, metas)

        out = ModelRunnerOutput()
        self._prompt_logprobs(batch, counts, hidden, out)
        self._sample(batch, counts, hidden, out)
        for req in batch:
            req.num_computed_tokens += counts[req.request_id]
        return out

    def _sample(self, batch: list[RunnerRequest], counts: dict[str, int], hidden: torch.Tensor,
                out: ModelRunnerOutput) -> None:
        rows: list[SamplingRow] = []
        last_positions: list[int] = []
        sampling: list[RunnerRequest] = []
        offset = 0
        for req in batch:
            n = counts[req.request_id]
            if req.num_computed_tokens + n == len(req.token_ids):
                last_positions.append(offset + n - 1)
                sampling.append(req)
                rows.append(SamplingRow(
                    params=req.params,
                    prompt_token_ids=req.token_ids[:req.num_prompt_tokens],
                    output_token_ids=req.token_ids[req.num_prompt_tokens:],
                    stop_token_ids=req.stop_token_ids,
                ))
            offset += n
        if not rows:
            return
        logits = self.model.compute_logits(hidden[self._long(last_positions)])
        result = self.sampler(logits, rows)
        for req, token, logprobs in zip(sampling, result.token_ids, result.logprobs):
            req.token_ids.append(token)
            out.sampled_token_ids[req.request_id] = [token]
            if logprobs is not None:
                out.logprobs[req.request_id] = [logprobs]

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
                rows = self._long(list(range(offset, offset + stop - start)))
                logits = self.model.compute_logits(hidden[rows])
                targets = req.token_ids[start + 1:stop + 1]
                entries = compute_logprobs(logits, targets, req.params.prompt_logprobs)
                out.prompt_logprobs[req.request_id] = (start + 1, entries)
            offset += n

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
