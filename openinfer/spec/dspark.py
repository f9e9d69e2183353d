"""The DSpark drafter (openinfer/models/dspark.py) in the engine.

Every step it writes its layers' context K/V for the step's rows from the target's
features (prompt chunks and verified rows alike; a rejected row's slot is written again
when its position is computed for real, before any block reads it: blocks read only
positions up to the last accepted one). Then, for every request that sampled, one pass
over its block gives up to ``num_speculative_tokens`` drafts, drawn one after another
(the Markov term needs the previous draft), each with the confidence head's estimate as
its confidence. Nothing is written past the sampled token: the block's own K/V live for
the pass only.
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
from openinfer.spec.context import DraftContext, DraftRequest
from openinfer.spec.draft_model import ModelDrafter, StepBatch, finish_drafts, pick_drafts
from openinfer.spec.proposer import Draft

logger = logging.getLogger(__name__)


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

    def propose(self, runner: DraftContext, step: StepBatch,
                sampled: list[DraftRequest]) -> dict[str, Draft]:
        drafter, first = self.drafter, self.first_layer
        caches = runner.layer_caches[first:]
        metas = step.metas[first:]
        # (The step's forward pass, which ran just before, left the features in the stack.)
        drafter.write_context(self.stack.features, step.positions, caches,
                              [meta.slot_mapping for meta in metas])
        if not sampled:
            return {}
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
        by_group = {g: self._tables(runner, sampled, g, context_lens)
                    for g in {runner.layer_group[first + i] for i in range(len(caches))}}
        tables, masks = zip(*(by_group[runner.layer_group[first + i]] for i in range(len(caches))))
        embedded = self.stack.embed_tokens(runner.long_tensor(ids))
        hidden = drafter.forward_block(embedded, runner.long_tensor(positions), caches,
                                       list(tables), list(masks))
        k = self.num_tokens  # the block's first k rows draft: the LM head reads only those
        hidden = hidden.view(len(sampled), block, -1)[:, :k]
        logits = self.target.compute_logits(drafter.norm(hidden.reshape(-1, hidden.shape[-1])))
        logits = logits.float().view(len(sampled), k, -1)
        drafts = [Draft() for _ in sampled]
        probs: list[list[torch.Tensor]] = [[] for _ in sampled]
        previous = runner.long_tensor([req.token_ids[-1] for req in sampled])
        for i in range(k):
            embedded_prev, markov_logits = drafter.markov(previous)
            confidences = drafter.confidence(hidden[:, i], embedded_prev)
            picked = pick_drafts(runner.sampler, logits[:, i] + markov_logits.float(), sampled,
                                 drafts, probs, confidences=confidences)
            previous = runner.long_tensor(picked)
        return finish_drafts(sampled, drafts, probs)

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
