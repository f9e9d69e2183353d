"""DeepSeek-V3's multi-token-prediction (NextN) module as a drafter.

The module at position i reads the embedding of token i + 1 and the target's hidden state
at i and predicts token i + 2, through one decoder block with its own (MLA) KV cache:

    h'_i = block(eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)]));  logits = head(norm(h'_i))

Each step it runs over the step's positions with the tokens that follow them (the token
the step sampled after the last accepted one; positions past a rejection get filler and are
written again later), which keeps its KV in step with the target's and gives, at each
sampling request's last accepted position, the first draft. For k > 1 the module is chained
on itself: its output h' stands in for the target's hidden state at the next position, as
in vLLM. Following vLLM, the token embedding is zeroed at position 0.
"""

from __future__ import annotations

import torch
from torch import nn

from openinfer.spec.context import DraftContext, DraftRequest
from openinfer.spec.draft_model import ModelDrafter, StepBatch, finish_drafts, pick_drafts
from openinfer.spec.proposer import Draft


def mtp_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's loaded MTP modules (None: it has none)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "mtp", None)
    return layers if layers is not None and len(layers) else None


class MTPDrafter(ModelDrafter):
    def __init__(self, model: nn.Module, first_layer: int, num_tokens: int) -> None:
        super().__init__(first_layer, num_tokens)
        layers = mtp_layers(model)
        if layers is None:
            raise ValueError("speculative_config.method 'mtp': the model has no MTP module "
                             "loaded (num_nextn_predict_layers is 0, or the checkpoint lacks "
                             "its weights)")
        self.layer = layers[0]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                 cache: torch.Tensor, meta) -> torch.Tensor:
        layer = self.layer
        embedded = layer.enorm(layer.embed_tokens(input_ids))
        embedded = embedded.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = layer.eh_proj(torch.cat([embedded, layer.hnorm(hidden)], dim=-1))
        out, residual = layer.block(positions, x, None, cache, meta)
        return out + residual

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.layer.shared_head
        return head.head(head.norm(hidden))

    def propose(self, runner: DraftContext, step: StepBatch, sampled: list[DraftRequest],
                budget: int | None = None) -> dict[str, Draft]:
        cache, meta = runner.layer_caches[self.first_layer], step.metas[self.first_layer]
        # The token after each scheduled position, as the step left the request.
        next_ids: list[int] = []
        last_rows: dict[str, int] = {}
        offset = 0
        for req, n, start in zip(step.requests, step.query_lens, step.starts):
            for i in range(start, start + n):
                next_ids.append(req.token_ids[i + 1] if i + 1 < len(req.token_ids) else 0)
            # The last accepted position: its next token is the one just sampled.
            last_rows[req.request_id] = offset + min(n, len(req.token_ids) - 1 - start) - 1
            offset += n
        hidden = self._forward(runner.long_tensor(next_ids), step.positions, step.hidden, cache, meta)
        lengths = self._chain_lengths(runner, sampled, budget)
        drafts = [Draft() for _ in sampled]
        probs: list[list[torch.Tensor]] = [[] for _ in sampled]
        rows = runner.long_tensor([last_rows[r.request_id] for r in sampled])
        current = hidden[rows]
        active = [i for i, n in enumerate(lengths) if n > 0]
        current = current[runner.long_tensor(active)]
        for j in range(max(lengths, default=0)):
            reqs = [sampled[i] for i in active]
            picked = pick_drafts(runner.sampler, self._logits(current), reqs,
                                 [drafts[i] for i in active], [probs[i] for i in active])
            keep = [n for n, i in enumerate(active) if lengths[i] > j + 1]
            if not keep:
                break
            active = [active[n] for n in keep]
            reqs = [sampled[i] for i in active]
            positions = [len(r.token_ids) - 1 + j for r in reqs]
            (meta_j,) = self._decode_metas(runner, reqs, positions)
            current = self._forward(runner.long_tensor([picked[n] for n in keep]),
                                    runner.long_tensor(positions), current[runner.long_tensor(keep)],
                                    cache, meta_j)
        return finish_drafts(sampled, drafts, probs)
