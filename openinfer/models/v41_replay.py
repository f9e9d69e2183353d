"""DeepSeek-V4.1's bounded replay (DeepInfer's "SWA bounded replay", exact here): the YOCO
consumer layers need only the last rows of a prefill. A consumer's window keys at a row
need that row's input, and its output at a row needs the keys of the window behind it; so
for the last consumer to answer the prefill's last row and hold an exact window for the
decodes after it, it computes the last ``K >= W`` rows, and each consumer before it ``W - 1``
more than the next one. The rows it skips are never written: the KV manager neither caches
those pages nor, on a hit, asks for them where the new request's own last rows begin
further back (``SlidingWindowSpec.replay_rows``)."""

from __future__ import annotations

import dataclasses
import os

import torch

from openinfer.attention.base import AttentionMetadata
from openinfer.attention.compressed import STEP_ROWS
from openinfer.models.arch import V41Arch

REPLAY_ROWS_ENV = "OPENINFER_V41_REPLAY_ROWS"


def replay_rows(v41: V41Arch) -> dict[int, int]:
    """Consumer layer -> the last rows of a prefill it computes (see the module docstring).
    ``$OPENINFER_V41_REPLAY_ROWS``: K (default the window), 0 turns it off."""
    value = os.environ.get(REPLAY_ROWS_ENV, "")
    if value == "0":
        return {}
    k = int(value) if value else v41.window
    if k < v41.window:
        raise ValueError(f"{REPLAY_ROWS_ENV}={k}: at least the window ({v41.window}) rows, or 0 (off)")
    if v41.engram is not None and v41.first_consumer in v41.engram.layer_ids:
        raise ValueError(f"bounded replay: the first consumer layer ({v41.first_consumer}) has "
                         f"Engram; set {REPLAY_ROWS_ENV}=0")
    consumers = range(v41.first_consumer, len(v41.compress_ratios))
    return {layer: k + (len(consumers) - 1 - i) * (v41.window - 1) for i, layer in enumerate(consumers)}


REPLAYED_FROM = "replayed_from"
"""A rows view's ``derived`` key: per sequence, the first position its layer computes."""


def rows_view(meta: AttentionMetadata, rows: torch.Tensor,
               computed_from: list[int]) -> AttentionMetadata:
    """``meta`` for the step rows ``rows`` alone (each sequence's a suffix of its own)."""
    lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    seq_of_row = torch.repeat_interleave(torch.arange(len(lens), device=rows.device), lens.long())[rows]
    counts = torch.bincount(seq_of_row, minlength=len(lens))
    query_lens = counts.tolist()
    return dataclasses.replace(
        meta, slot_mapping=meta.slot_mapping[rows],
        query_start_loc=torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(meta.query_start_loc.dtype),
        max_query_len=max(query_lens, default=0), query_lens_list=query_lens,
        derived={REPLAYED_FROM: computed_from, STEP_ROWS: rows})


def replayed_from(rows: int, meta: AttentionMetadata) -> list[int]:
    """Per sequence, the first position a layer computing a prefill's last ``rows`` does."""
    return [max(0, end - rows) if end >= 0 else 0 for end in meta.prefill_ends]


def replayed_rows(rows: int | None, positions: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor | None:
    """The step rows a layer computing each prefill's last ``rows`` computes (None: all)."""
    if rows is None or meta.prefill_ends is None:
        return None
    starts = replayed_from(rows, meta)
    if all(s <= end - n for s, end, n in zip(starts, meta.seq_lens_list, meta.query_lens_list,
                                             strict=True)):
        return None
    lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    first = torch.repeat_interleave(torch.tensor(starts, device=positions.device), lens.long())
    return (positions >= first).nonzero().flatten()
