"""CUDA graphs for decode steps: a step's forward pass as one replay instead of hundreds of
kernel launches.

A small decode batch on a GPU is bound by launching kernels (a few microseconds each, a few
hundred per step), not by their work. So the worker captures the model's forward pass once
per *capture size* (1, 2, 4, 8, then every 16 up to the largest batch) over static input
buffers, and a step whose requests are all plain decodes (one token each, no drafts) pads to
the smallest captured size that holds it, copies its inputs into the buffers and replays::

    step of 5 decodes  ->  graph of size 8:
      input_ids, positions      | t0 t1 t2 t3 t4 | 0  0  0  |
      slot_mapping (per group)  | s0 s1 s2 s3 s4 | -1 -1 -1 |   (-1: the KV write skips it)
      seq_lens (per group)      | l0 l1 l2 l3 l4 | 0  0  0  |   (0: attends nothing)
      block_tables (per group)  | the step's rows, then stale rows nobody reads     |
      hidden = outputs[8][:5]

A graph sees new values only through its buffers; every launch argument was fixed at capture.
So each size's attention plan is made from ``max_model_len``, not from the step's longest
context: the number of split-KV parts is planned for the longest context any replay may
have, and the kernel sizes each sequence's splits from its own length (a split past its end
reads nothing and weighs nothing in the merge). The block tables are as wide as
``max_model_len`` needs. Prefills, chunked prefills, drafts to verify, and batches larger than
the largest size run eagerly.

Graphs need CUDA (``capture=True``). With ``capture=False`` the same buffers, padding and
plans run eagerly (the model is called on the buffers): that is how the tests check this
path on a CPU, with the Triton kernels in Triton's interpreter.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import torch

from openinfer.attention.base import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

LARGEST_CAPTURE_SIZE = 256


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16 up to ``max_batch`` (capped at
    LARGEST_CAPTURE_SIZE), and ``max_batch`` itself so no batch the scheduler makes is
    padded past it. Padding wastes at most 15 rows above 8."""
    top = min(max_batch, LARGEST_CAPTURE_SIZE)
    sizes = {s for s in (1, 2, 4, 8) if s <= top} | set(range(16, top + 1, 16)) | {top}
    return sorted(sizes)


class DecodeGraphs:
    """Static buffers and one captured forward pass per capture size (see the module
    docstring). ``model(input_ids, positions, layer_caches, metas)`` is the runner's model;
    ``layer_group`` maps each layer to its KV group; the block tables are as wide as
    ``max_model_len``'s blocks (``max_blocks``)."""

    def __init__(self, model: Callable, layer_caches: list[torch.Tensor], layer_group: list[int],
                 num_groups: int, backend: AttentionBackend, block_size: int, max_model_len: int,
                 max_batch: int, device: torch.device, capture: bool) -> None:
        self.model = model
        self.layer_caches = layer_caches
        self.layer_group = layer_group
        self.backend = backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.capture = capture
        self.sizes = capture_sizes(max_batch)
        self.max_blocks = -(-max_model_len // block_size)
        largest = self.sizes[-1]

        def buffer(*shape: int, dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.input_ids = buffer(largest, dtype=torch.long)
        self.positions = buffer(largest, dtype=torch.long)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.slot_mapping = [buffer(largest, dtype=torch.long, fill=-1) for _ in range(num_groups)]
        self.seq_lens = [buffer(largest, dtype=torch.int32) for _ in range(num_groups)]
        self.block_tables = [buffer(largest, self.max_blocks, dtype=torch.int32)
                             for _ in range(num_groups)]
        self.metas: dict[int, list[AttentionMetadata]] = {}
        """Per capture size, per layer: the metadata over the buffers' first ``size`` rows
        (kept: the attention plans the first run made live in its ``derived``)."""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        """Per capture size: the hidden states its graph writes."""
        self.replays: Counter[int] = Counter()
        """Steps run per capture size."""

    def _layer_metas(self, size: int) -> list[AttentionMetadata]:
        metas = self.metas.get(size)
        if metas is None:
            by_group = [AttentionMetadata(
                backend=self.backend, slot_mapping=self.slot_mapping[g][:size],
                query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[g][:size],
                block_tables=self.block_tables[g][:size], num_decodes=size, max_query_len=1,
                max_seq_len=self.max_model_len, block_size=self.block_size,
                # The plan is made from these: the longest context any replay may have.
                query_lens_list=[1] * size, seq_lens_list=[self.max_model_len] * size)
                for g in range(len(self.slot_mapping))]
            metas = self.metas[size] = [by_group[g] for g in self.layer_group]
        return metas

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.layer_caches,
                          self._layer_metas(size))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first (the smaller graphs then fit in the memory the
        largest one's pool already holds). The buffers hold padding only (slot -1, length 0),
        so capturing writes no KV and reads none."""
        if not self.capture:
            return
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        for size in reversed(self.sizes):
            side = torch.cuda.Stream(self.device)  # warm-up off the default stream (torch's advice)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(size)  # compiles the kernels; makes the size's attention plans
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("CUDA graphs: captured %d decode sizes (1 .. %d) in %.1f s, %.0f MiB",
                    len(self.sizes), self.sizes[-1], time.perf_counter() - start, used / 2**20)

    def size_for(self, num_seqs: int, group_metas: list[AttentionMetadata]) -> int | None:
        """The capture size a decode-only step of ``num_seqs`` sequences runs at, or None
        where it must run eagerly (too many sequences, or a block table wider than
        ``max_model_len``'s)."""
        if num_seqs > self.sizes[-1]:
            return None
        if any(meta.block_tables.shape[1] > self.max_blocks for meta in group_metas):
            return None
        return next(size for size in self.sizes if size >= num_seqs)

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
            group_metas: list[AttentionMetadata]) -> torch.Tensor:
        """The hidden states of a decode-only step (its eager metadata per KV group, which
        the buffers copy), [num_seqs, hidden]: a view of the graph's output, valid until
        the next replay."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        for g, meta in enumerate(group_metas):
            self.slot_mapping[g][:n].copy_(meta.slot_mapping)
            self.slot_mapping[g][n:size].fill_(-1)
            self.seq_lens[g][:n].copy_(meta.seq_lens)
            self.seq_lens[g][n:size].zero_()
            width = meta.block_tables.shape[1]
            self.block_tables[g][:n, :width].copy_(meta.block_tables)
        self.replays[size] += 1
        if not self.capture:
            return self._forward(size)[:n]
        self.graphs[size].replay()
        return self.outputs[size][:n]
