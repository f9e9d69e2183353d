"""The DSpark drafter (openinfer/models/dspark.py) in the engine.

Every step it writes its layers' context K/V for the step's rows from the target's
features (prompt chunks and verified rows alike; a rejected row's slot is written again
when its position is computed for real, before any block reads it: blocks read only
positions up to the last accepted one). Then, for every request that sampled, one pass
over its block gives up to ``num_speculative_tokens`` drafts, drawn one after another
(the Markov term needs the previous draft), each with the confidence head's estimate as
its confidence. Nothing is written past the sampled token: the block's own K/V live for
the pass only. Under the budget scheduler (spec/budget.py) a draft is drawn only where its
chance of acceptance ranks it among the next step's verified rows.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from openinfer.config import ModelConfig
from openinfer.model_source import SMOLLM2_FILE
from openinfer.models.arch import ArchConfig
from openinfer.models.dspark import (
    DSparkConfig,
    DSparkDrafterModel,
    check_drafter,
    read_drafter_config,
)
from openinfer.models.gemm_plans import plan_gemms
from openinfer.models.llama import DecoderStack
from openinfer.models.loader import default_dtype, load_weights, process_weights_after_loading
from openinfer.models.platform import make_batch_invariant
from openinfer.spec.budget import keep_within_budget
from openinfer.spec.context import DraftContext, DraftRequest
from openinfer.spec.draft_model import ModelDrafter, StepBatch, finish_drafts, pick_drafts
from openinfer.spec.proposer import Draft

logger = logging.getLogger(__name__)

LM_HEAD_SLACK = 32
"""Under a budget, the target's head runs once over every row the requests drafting at the
first position may draft, unless that is this many rows past the budget; else once a
position over the rows kept there. One pass reads the head's weights once (SmolLM2's are
56 MB in bfloat16: ~3 ms on a 2-core CPU, about the compute of 8 rows), a pass a position
reads them k times; past the slack the wasted rows cost more than the reads."""


def feature_stack(target: nn.Module) -> DecoderStack:
    """The target's decoder stack, where it can hand a drafter its layers' inputs."""
    stack = getattr(target, "model", None)
    if not (isinstance(stack, DecoderStack) and "forward" not in type(stack).__dict__
            and "_run_layers" not in type(stack).__dict__):
        raise ValueError(f"speculative_config.method 'dspark': {type(target).__name__} cannot "
                         "hand a drafter its layers' hidden states yet (Llama-family "
                         "decoder stacks can)")
    return stack


SHIPPED_DRAFTERS = {SMOLLM2_FILE: "smollm2-135m-instruct-dspark"}
"""Target checkpoint file -> the drafter trained for it that ships in openinfer/drafters
(scripts/train_dspark.py)."""


def shipped_drafter(target_path: str) -> str:
    """The drafter that ships for the target at ``target_path``; ValueError where none does."""
    name = SHIPPED_DRAFTERS.get(Path(target_path).name)
    if name is None:
        raise ValueError("speculative_config.model (a DSpark drafter checkpoint) is required for "
                         "method 'dspark': a drafter ships only for the built-in smollm2")
    return str(Path(__file__).resolve().parent.parent / "drafters" / name)


def load_dspark_drafter(path: str | None, target: nn.Module, target_config: ModelConfig,
                        device: str, progress: bool) -> DSparkDrafterModel:
    """The drafter at ``path`` (None: the one that ships for the target), its weights
    loaded, the target told which of its layers' inputs to keep."""
    path = path or shipped_drafter(target_config.path)
    hf = read_drafter_config(path)
    dspark = DSparkConfig.from_hf(hf)
    target_arch = ArchConfig.from_hf(target_config.hf_config, source_dir=target_config.path)
    check_drafter(hf, dspark, target_arch)
    stack = feature_stack(target)
    with torch.device(device), default_dtype(target_config.dtype):
        model = DSparkDrafterModel(ArchConfig.from_hf(hf), dspark)
    load_weights(model, Path(path), progress=progress, hf_config=hf)
    process_weights_after_loading(model)
    if target_config.batch_invariant:
        make_batch_invariant(model)
    else:
        plan_gemms(model, None)
    stack.feature_layers = dspark.target_layer_ids
    logger.info("DSpark drafter %s: %d layers, blocks of %d, features of target layers %s, "
                "Markov rank %d", path, len(model.layers), dspark.block_size,
                list(dspark.target_layer_ids), dspark.markov_rank)
    return model.eval()


class DSparkDrafter(ModelDrafter):
    def __init__(self, drafter: DSparkDrafterModel, target: nn.Module, first_layer: int,
                 num_tokens: int) -> None:
        block = drafter.dspark.block_size
        if num_tokens > block:
            raise ValueError(f"speculative_config.num_speculative_tokens {num_tokens} exceeds the "
                             f"DSpark drafter's block ({block} drafts per pass)")
        super().__init__(first_layer, num_tokens)
        self.drafter = drafter
        self.target = target
        self.stack = feature_stack(target)

    def propose(self, runner: DraftContext, step: StepBatch, sampled: list[DraftRequest],
                budget: int | None = None) -> dict[str, Draft]:
        drafter, first = self.drafter, self.first_layer
        caches = runner.layer_caches[first:]
        metas = step.metas[first:]
        # (The step's forward pass, which ran just before, left the features in the stack.)
        drafter.write_context(self.stack.features, step.positions, caches,
                              [meta.slot_mapping for meta in metas])
        if not sampled or budget == 0:
            return {}
        hidden = self._block_states(runner, sampled)
        drafts = [Draft() for _ in sampled]
        probs: list[list[torch.Tensor]] = [[] for _ in sampled]
        previous = [req.token_ids[-1] for req in sampled]
        kept = _Kept(len(sampled), budget)
        alive = list(range(len(sampled)))
        head, slot = None, {}
        for i in range(self.num_tokens):
            rows = runner.long_tensor(alive)
            embedded = drafter.markov_embed(runner.long_tensor([previous[n] for n in alive]))
            confidences = drafter.confidence(hidden[rows, i], embedded)
            keep = kept.select(alive, confidences.tolist())
            if len(keep) < len(alive):
                index = runner.long_tensor(keep)
                alive, rows = [alive[m] for m in keep], rows[index]
                embedded, confidences = embedded[index], confidences[index]
            if not alive:
                break
            if i == 0:
                head, slot = self._head_upfront(hidden, alive, rows, budget)
            if head is not None:
                base = head[runner.long_tensor([slot[n] for n in alive]), i]
            else:
                base = drafter.head_logits(hidden[rows, i], self.target.compute_logits)
            picked = pick_drafts(runner.sampler, base.float() + drafter.markov_logits(embedded),
                                 [sampled[n] for n in alive], [drafts[n] for n in alive],
                                 [probs[n] for n in alive], confidences=confidences)
            for n, token in zip(alive, picked):
                previous[n] = token
        return finish_drafts(sampled, drafts, probs)

    def _head_upfront(self, hidden: torch.Tensor, alive: list[int], rows: torch.Tensor,
                      budget: int | None) -> tuple[torch.Tensor | None, dict[int, int]]:
        """The head's logits for every row the requests drafting at the first position may
        draft [A, depth, V] (and request -> its row there), where one pass over them beats a
        pass per position; else None."""
        depth = self.num_tokens if budget is None else min(self.num_tokens, budget)
        if budget is not None and len(alive) * depth > budget + LM_HEAD_SLACK:
            return None, {}
        head = self.drafter.head_logits(hidden[rows, :depth], self.target.compute_logits)
        return head, {n: j for j, n in enumerate(alive)}

    def _block_states(self, runner: DraftContext, sampled: list[DraftRequest]) -> torch.Tensor:
        """Every request's block through the draft layers: final states [R, B, hidden]."""
        drafter, first = self.drafter, self.first_layer
        block = drafter.dspark.block_size
        # Past the RoPE table (a block that starts just before the context limit), rows keep
        # its last position: their drafts lie past max_model_len and are never verified.
        last = drafter.max_position - 1
        # Request r's block: the token just sampled (position p + 1), then noise.
        ids, positions, context_lens = [], [], []
        for req in sampled:
            p = len(req.token_ids) - 2  # the last accepted position: its K/V are cached
            ids += [req.token_ids[-1]] + [drafter.dspark.noise_token_id] * (block - 1)
            positions += [min(q, last) for q in range(p + 1, p + 1 + block)]
            context_lens.append(p + 1)
        num_layers = len(runner.layer_caches) - first
        by_group = {g: self._tables(runner, sampled, g, context_lens)
                    for g in {runner.layer_group[first + i] for i in range(num_layers)}}
        tables, masks = zip(*(by_group[runner.layer_group[first + i]] for i in range(num_layers)))
        embedded = self.stack.embed_tokens(runner.long_tensor(ids))
        hidden = drafter.forward_block(embedded, runner.long_tensor(positions),
                                       runner.layer_caches[first:], list(tables), list(masks))
        return hidden.view(len(sampled), block, -1)

    def _tables(self, runner: DraftContext, requests: list[DraftRequest], group: int,
                context_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The requests' context block tables in KV group ``group``, padded [R, blocks], and
        the key mask [R, 1, 1, blocks * block_size + B] of their blocks' attention."""
        bs, block = runner.block_size, self.drafter.dspark.block_size
        blocks = -(-max(context_lens) // bs)
        tables = runner.long_tensor([(req.block_ids[group][:blocks] + [0] * blocks)[:blocks]
                                     for req in requests])
        keys = torch.arange(blocks * bs + block, device=tables.device)
        lengths = runner.long_tensor(context_lens)
        mask = (keys[None, :] < lengths[:, None]) | (keys[None, :] >= blocks * bs)
        return tables.view(len(requests), blocks), mask[:, None, None, :]


class _Kept:
    """Under a budget (spec/budget.py), which requests draft the next position: those whose
    draft there can rank among the budget's likeliest of every draft made so far."""

    def __init__(self, num_requests: int, budget: int | None) -> None:
        self.budget = budget
        self.survival = [1.0] * num_requests
        self.made: list[float] = []
        """Survivals of the drafts made so far."""

    def select(self, alive: list[int], confidences: list[float]) -> list[int]:
        """Indices into ``alive`` (requests, with their next drafts' confidences) that draft."""
        if self.budget is None:
            return list(range(len(alive)))
        candidates = [self.survival[n] * c for n, c in zip(alive, confidences)]
        keep = keep_within_budget(self.made, candidates, self.budget)
        for m in keep:
            self.survival[alive[m]] = candidates[m]
            self.made.append(candidates[m])
        return keep

