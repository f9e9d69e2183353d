"""DeepSeek-V4's attention over its paged state (openinfer/models/deepseek_v4.py): each query
attends over a sliding window of keys (one shared head, K = V) plus the compressed *entries*
its position can see, with a per-head sink logit in the softmax. This module holds the page
arithmetic (which page and slot holds a token's row or an entry) and the sink softmax; the
model keeps the projections, the compressors that pool entries and the indexer that picks
them.

Pages: window keys and a compressor's raw rows are sliding-window pages of one row per token
(``[num_blocks, block_size, 1, dim]``, K half and V half); entries are ``CompressedSpec``
pages, ``block_size // ratio`` entries each, entry w in the page of its group's last token:

    tokens   0 1 2 3 | 4 5 6 7 | ...      (ratio 4, block_size 8: two entries a page)
    entry    w = 0     w = 1
    page     table[((w + 1) * ratio - 1) // block_size], slot w % (block_size // ratio)

The step's sequences attend in padded batches (``SequenceBatch``): its decodes as one, its
prefill chunks in groups of similar length, each group one call over its window keys and
entries gathered into ``[P, keys, D]`` and masked per query. What the pages hold for a step
(the batches, the rows they read, the entries that complete) is worked out once per step from
the lengths and block tables, with no host sync per layer. No fused kernel yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from openinfer.attention.base import AttentionMetadata


def entry_index(ratio: int, block_size: int, tables: torch.Tensor,
                count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, slot) of entries 0 .. count - 1 for each row of ``tables`` [B, blocks]."""
    w = torch.arange(count, device=tables.device)
    block = ((w + 1) * ratio - 1) // block_size
    slot = w % max(1, block_size // ratio)
    block = block.clamp(max=tables.shape[1] - 1)  # entries past a row's own are masked
    return tables[:, block].long(), slot.expand(tables.shape[0], -1)


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor,
                      sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax over the allowed keys and one sink logit per head, times the keys (K = V), for
    a padded batch: q [P, N, H, D], keys [P, L, D], allowed [P, N, L] -> [P, N, H, D]. A query
    with no allowed key gets zeros (the sink takes all)."""
    logits = torch.einsum("pnhd,pld->pnhl", q, keys) * scale
    logits = logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
    sink = sinks.view(1, 1, -1, 1).expand(*q.shape[:3], 1)
    probs = torch.cat([logits.float(), sink], -1).softmax(-1)[..., :-1].to(q.dtype)
    return torch.einsum("pnhl,pld->pnhd", probs, keys)


# ---- a step's sequences in padded batches, its new entries: worked out once per step ----------

PAD_WASTE = 2
"""A prefill chunk joins a group padded to a longer one's length only when that at most doubles
its rows (so padding never more than doubles a group's work)."""


@dataclass
class SequenceBatch:
    """Some of a step's sequences as a padded batch of their queries: sequence ``seqs[p]``'s
    queries are the step's rows ``rows[p, :n_p]`` at positions ``positions[p, :n_p]``; the
    padding repeats its last row and position (``valid`` False), so every query has keys."""

    seqs: torch.Tensor
    """[P] the sequences' indices in the step."""
    rows: torch.Tensor
    """[P, N] each query's row in the step."""
    valid: torch.Tensor
    """[P, N] False on padding."""
    positions: torch.Tensor
    """[P, N] each query's position in its sequence."""
    ends: np.ndarray
    """[P] each sequence's length after the step (host ints)."""
    first_positions: np.ndarray
    """[P] each sequence's first query position (host ints)."""
    take: torch.Tensor
    """[Q] the real queries' indices in the flattened [P * N] batch ..."""
    to_rows: torch.Tensor
    """[Q] .. and their rows in the step: ``out.index_copy_(0, to_rows, batch_out[take])``."""
    derived: dict[Any, Any] = field(default_factory=dict)
    """Index tensors made by the first layer that needs them (per slot group and window)."""


def step_batches(meta: AttentionMetadata) -> list[SequenceBatch]:
    """The step's decodes as one batch, then its prefill chunks in groups of similar length
    (``PAD_WASTE``); made once per step."""
    cached = meta.derived.get("compressed_batches")
    if cached is not None:
        return cached
    q_lens = np.asarray(meta.query_lens_list, dtype=np.int64)
    ends = np.asarray(meta.seq_lens_list, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(q_lens)[:-1]))
    nd = meta.num_decodes
    groups = [list(range(nd))] if nd else []
    group: list[int] = []
    for b in sorted(range(nd, meta.num_seqs), key=lambda b: -q_lens[b]):
        if q_lens[b] == 0:
            continue
        if group and q_lens[b] * PAD_WASTE < q_lens[group[0]]:
            groups.append(group)
            group = []
        group.append(b)
    groups += [group] if group else []
    device = meta.block_tables.device
    batches = []
    for seqs in groups:
        idx = np.asarray(seqs, dtype=np.int64)
        n = q_lens[idx]
        offset = np.minimum(np.arange(n.max())[None, :], n[:, None] - 1)
        rows = starts[idx, None] + offset
        positions = (ends[idx] - n)[:, None] + offset
        valid = offset == np.arange(n.max())[None, :]

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        batches.append(SequenceBatch(
            seqs=tensor(idx), rows=tensor(rows), valid=tensor(valid),
            positions=tensor(positions), ends=ends[idx], first_positions=ends[idx] - n,
            take=tensor(np.flatnonzero(valid)), to_rows=tensor(rows[valid])))
    meta.derived["compressed_batches"] = batches
    return batches


def batch_window(window_cache: torch.Tensor, meta: AttentionMetadata, batch: SequenceBatch,
                 window: int, written_from: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's window keys: (keys [P, L, D], allowed [P, N, L]); sequence p's keys are
    positions ``first_p .. end_p - 1``, the oldest its first query sees on. ``written_from``:
    per sequence of the step, the first position whose key was written (the keys before it
    are not allowed)."""
    key = ("window", id(meta), window)
    if key not in batch.derived:
        bs = meta.block_size
        firsts = np.maximum(0, batch.first_positions - window + 1)
        span = int((batch.ends - firsts).max())
        key_pos = torch.from_numpy(firsts[:, None] + np.arange(span)[None, :]).to(batch.seqs.device)
        last = torch.from_numpy(batch.ends - 1).to(batch.seqs.device)
        t = batch.positions[:, :, None]  # (a key past its sequence's end is after every query)
        allowed = (key_pos[:, None, :] <= t) & (key_pos[:, None, :] > t - window)
        if written_from is not None:
            start = torch.tensor(written_from, device=key_pos.device)[batch.seqs]
            allowed &= (key_pos >= start[:, None])[:, None, :]
        key_pos = torch.minimum(key_pos, last[:, None])  # read some row of the sequence there
        pages = meta.block_tables[batch.seqs].long().gather(1, key_pos // bs)
        batch.derived[key] = (pages, key_pos % bs, allowed)
    pages, offsets, allowed = batch.derived[key]
    return window_cache[0][pages, offsets, 0], allowed


def batch_entries(entry_cache: torch.Tensor, meta: AttentionMetadata, batch: SequenceBatch,
                  ratio: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch's entries so far (groups complete by each sequence's end): (entries [P, C, D],
    visible [P, N, C]: those complete by each query's position); None before the first."""
    key = ("entries", id(meta), ratio)
    if key not in batch.derived:
        count = int(batch.ends.max()) // ratio
        if not count:
            batch.derived[key] = None
        else:
            pages, slots = entry_index(ratio, meta.block_size, meta.block_tables[batch.seqs], count)
            w = torch.arange(count, device=pages.device)
            visible = w[None, None, :] < ((batch.positions + 1) // ratio)[:, :, None]
            batch.derived[key] = (pages, slots, visible)
    found = batch.derived[key]
    if found is None:
        return None
    pages, slots, visible = found
    return entry_cache[pages, slots], visible


@dataclass
class NewEntries:
    """The entries whose groups of ``ratio`` tokens complete in a step, over all its sequences
    (in sequence order): where each is stored and, for pooling, the raw rows it pools."""

    positions: torch.Tensor
    """[E] each entry's RoPE position (its group's first token)."""
    slot: tuple[torch.Tensor, torch.Tensor]
    """(page, slot) [E] where each entry is stored."""
    has_previous: torch.Tensor
    """[E] False for entry 0."""
    group: tuple[torch.Tensor, torch.Tensor] | None = None
    """(page, offset) [E, ratio] of each entry's own group in the raw rows' pages."""
    previous: tuple[torch.Tensor, torch.Tensor] | None = None
    """(page, offset) [E, ratio] of the group before it (some row where there is none)."""


def new_entries(entry_meta: AttentionMetadata, ratio: int,
                raw_meta: AttentionMetadata | None = None) -> NewEntries | None:
    """The step's complete-now entries (sequence b's tokens are ``seq_len - query_len ..
    seq_len - 1``), with their raw rows where ``raw_meta`` (their pages) is given; made once
    per step; None when no group completes."""
    key = ("new_entries", ratio, None if raw_meta is None else id(raw_meta))
    if key in entry_meta.derived:
        return entry_meta.derived[key]
    ends = np.asarray(entry_meta.seq_lens_list, dtype=np.int64)
    firsts = (ends - np.asarray(entry_meta.query_lens_list, dtype=np.int64)) // ratio
    counts = np.maximum(0, ends // ratio - firsts)
    found = None
    if counts.sum():
        seq = np.repeat(np.arange(len(ends)), counts)
        w = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + firsts[seq]
        device = entry_meta.block_tables.device
        seq_t, w_t = torch.from_numpy(seq).to(device), torch.from_numpy(w).to(device)
        entry_block = ((w_t + 1) * ratio - 1) // entry_meta.block_size
        found = NewEntries(positions=w_t * ratio, has_previous=w_t > 0, slot=(
            entry_meta.block_tables.long()[seq_t, entry_block],
            w_t % max(1, entry_meta.block_size // ratio)))
        if raw_meta is not None:
            bs, tables = raw_meta.block_size, raw_meta.block_tables.long()
            tokens = w_t[:, None] * ratio + torch.arange(ratio, device=device)[None, :]
            before = (tokens - ratio).clamp(min=0)
            found.group = (tables[seq_t[:, None], tokens // bs], tokens % bs)
            found.previous = (tables[seq_t[:, None], before // bs], before % bs)
    entry_meta.derived[key] = found
    return found


def store_token_entries(entry_cache: torch.Tensor, meta: AttentionMetadata,
                        entries: torch.Tensor) -> None:
    """Ratio 1: each step row's entry ([T, D]) into its token's own slot (a padded decode
    graph's rows, slot -1, are skipped)."""
    written = meta.slot_mapping >= 0
    slot = meta.slot_mapping[written].long()
    bs = meta.block_size
    entry_cache[slot // bs, slot % bs] = entries[written].to(entry_cache.dtype)


def step_rows(meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
    """The rows of the whole step that rows ``rows`` of ``meta`` are (``meta`` may be a view
    of some rows: ``STEP_ROWS`` in its ``derived``)."""
    whole = meta.derived.get(STEP_ROWS)
    return rows if whole is None else whole[rows]


STEP_ROWS = "step_rows"
"""A rows view's ``derived`` key: which rows of the whole step its rows are."""
