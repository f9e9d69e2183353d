"""What each layer stores per token, how layers group into block tables, and what one
cached block's bytes are.

A model declares one spec per layer (``model.kv_cache_specs``). Layers with the same
spec share one block table per request (a *layer group*) and one cache tensor on the
device. The scheduler and KV manager only see groups and block counts, so a new kind
of layer (MLA latent, sliding window, compressed) is a new spec class, not a scheduler
change. What leaves the device (host tier, file store, KV transfer, KV events) reads
the ``BlockLayout`` derived from the groups, never a hard-coded K/V pair.

Pure Python: shapes and dtypes are named, not tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


class _PagedSpec:
    """What every paged spec derives from its ``page_shape``, ``dtype`` and ``block_size``."""

    block_size: int
    dtype: str

    @property
    def page_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def bytes_per_block(self) -> int:
        """Bytes one layer of this spec needs for one block."""
        n = 1
        for d in self.page_shape:
            n *= d
        return n * DTYPE_BYTES[self.dtype]

    @property
    def cacheable(self) -> bool:
        """Whether a full block of this layer is a function of its prefix alone, so it may
        be kept by content hash (prefix cache, tiers, KV transfer)."""
        return True

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a request with ``num_tokens`` tokens holds in a layer of this spec."""
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(_PagedSpec):
    """Standard (MHA/GQA) attention: a K and a V vector per KV head per token."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    kind = "full_attention"

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One layer's share of one block: ``[K|V, token, head, dim]``."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class MLALatentSpec(_PagedSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): per token one compressed KV vector of
    ``latent_dim`` (kv_lora_rank) values, already normalised, followed by the ``rope_dim``
    values of the shared, rotated key part. No heads: every query head reads the same entry
    (the keys and values of all heads are linear maps of it)."""

    block_size: int
    latent_dim: int
    rope_dim: int
    dtype: str

    kind = "mla_latent"

    @property
    def entry_dim(self) -> int:
        return self.latent_dim + self.rope_dim

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One layer's share of one block: ``[token, latent | rope]``."""
        return (self.block_size, self.entry_dim)


@dataclass(frozen=True)
class SlidingWindowSpec(_PagedSpec):
    """Sliding-window attention: K and V like full attention, but query ``p`` reads only keys
    ``p - window + 1 .. p``. A request holds only the blocks its next queries can still see;
    older table entries are released (``SKIPPED``) as it advances, so the layer's KV is
    O(window) per request, not O(length)."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    window: int
    shared_kv: bool = False
    """Keys are the values (DeepSeek-V4): one copy is stored, seen as both halves."""
    replay_rows: int | None = None
    """The layer computes only the last this many rows of a prefill (DeepSeek-V4.1's bounded
    replay; every row after it): its pages before them are never written, so they are not
    cached, and a prefix hit needs its pages behind the hit point only where the new
    request's own last ``replay_rows`` reach behind it."""

    kind = "sliding_window"

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (1 if self.shared_kv else 2, self.block_size, self.num_kv_heads, self.head_dim)

    def first_needed_block(self, position: int) -> int:
        """The first block a query at ``position`` (or any later one) reads."""
        return max(0, position - self.window + 1) // self.block_size

    def max_live_blocks(self, num_new_tokens: int) -> int:
        """Blocks a request holds in this group at most while ``num_new_tokens`` of its tokens
        are computed in one step: the window behind its last full block (a snapshot point),
        plus the partial block and the new tokens' blocks."""
        return -(-(self.window - 1) // self.block_size) + 2 + -(-num_new_tokens // self.block_size)

    def in_snapshot(self, block: int, interval: int) -> bool:
        """Whether block ``block`` holds part of the window behind a snapshot point (a
        multiple of ``interval`` tokens): the first such point after it is the only one
        whose window can reach back to it."""
        point = -(-(block + 1) * self.block_size // interval) * interval
        return self.first_needed_block(point) <= block


@dataclass(frozen=True)
class CompressedSpec(_PagedSpec):
    """Compressed attention entries (DeepSeek-V4): one ``entry_dim`` vector per ``ratio``
    tokens. Entry ``w`` summarises tokens ``w * ratio .. (w + 1) * ratio - 1`` and lives in
    the page of the token block holding its last token, so a page is full (and cacheable by
    that block's hash) once its block is computed. A page holds ``block_size / ratio`` entries
    (ratio dividing the block size), or one (ratio a multiple of it: only every
    ``ratio / block_size``-th page is used)."""

    block_size: int
    ratio: int
    entry_dim: int
    dtype: str

    kind = "compressed"

    def __post_init__(self) -> None:
        if self.block_size % self.ratio and self.ratio % self.block_size:
            raise ValueError(f"compress ratio {self.ratio} and block size {self.block_size}: "
                             "one must divide the other")

    @property
    def entries_per_page(self) -> int:
        return max(1, self.block_size // self.ratio)

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.entries_per_page, self.entry_dim)

    def entry_slot(self, entry: int) -> tuple[int, int]:
        """(token block index, slot in its page) of entry ``entry``."""
        return ((entry + 1) * self.ratio - 1) // self.block_size, entry % self.entries_per_page


SKIPPED = -1
"""A block-table entry released because no later query reads it (sliding windows). The
runner's tables never read it; the attention metadata maps it to block 0."""

KVSpec = FullAttentionSpec | MLALatentSpec | SlidingWindowSpec | CompressedSpec


@dataclass(frozen=True)
class LayerGroup:
    spec: KVSpec
    layers: tuple[int, ...]
    """Model layer indices that share this group's block table."""

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block * len(self.layers)


def group_layers(specs: list[KVSpec | None]) -> list[LayerGroup]:
    """Group layers with identical specs, in order of first appearance (a layer without a
    KV cache has spec None and joins no group).

    All groups share one pool of pages, a page being one block of every layer of a group, so
    groups are cut to about one page size: the larger of the biggest single layer's block
    and the smallest spec's whole block (all its layers). gpt-oss's 12 window and 12 full
    layers stay two groups of 12; Gemma 3's 5:1 pattern becomes one full group and five window
    groups of its size; DeepSeek-V4's slots, whose bytes per block differ 64-fold, become
    groups of about one compressor row page each, so its small compressed pages are not
    padded to the size of a group of all its window layers."""
    by_spec: dict[KVSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        if spec is not None:
            by_spec.setdefault(spec, []).append(layer)
    if not by_spec:
        return []
    target = max(max(spec.bytes_per_block for spec in by_spec),
                 min(spec.bytes_per_block * len(layers) for spec, layers in by_spec.items()))
    groups = []
    for spec, layers in by_spec.items():
        size = max(1, target // spec.bytes_per_block)
        groups += [LayerGroup(spec, tuple(layers[i:i + size])) for i in range(0, len(layers), size)]
    return groups


def page_bytes(groups: list[LayerGroup]) -> int:
    """Bytes of one page of the shared pool: the largest group's block."""
    return max(g.bytes_per_block for g in groups)


@dataclass(frozen=True)
class BlockLayout:
    """One cached block as bytes: the cacheable groups' pages, group after group, each
    ``[layer][page_shape]`` in the group's dtype (what the device tensor of a group holds
    for one block id, so a group's part is one contiguous copy).

    Everything that moves a block off the device or names its contents reads this: the
    host tier and file store (segment sizes), the file header and the KV-transfer
    handshake (``describe()``: instances and files that disagree on any field never
    exchange bytes), KV events (``block_size``)."""

    groups: tuple[LayerGroup, ...]
    group_ids: tuple[int, ...]
    """Each of ``groups``' index among all the model's layer groups (a block's device ids
    come per model group)."""
    model_fingerprint: str = ""

    @staticmethod
    def of(groups: list[LayerGroup], model_fingerprint: str = "") -> BlockLayout:
        ids = tuple(i for i, g in enumerate(groups) if g.spec.cacheable)
        return BlockLayout(tuple(groups[i] for i in ids), ids, model_fingerprint)

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    @property
    def segment_bytes(self) -> list[int]:
        """Bytes of each group's part of a block, in order."""
        return [g.bytes_per_block for g in self.groups]

    @property
    def block_bytes(self) -> int:
        return sum(self.segment_bytes)

    def describe(self) -> dict[str, Any]:
        """Every field two parties must agree on (JSON- and msgpack-friendly)."""
        return {
            "model_fingerprint": self.model_fingerprint,
            "block_size": self.block_size,
            "groups": [{"kind": g.spec.kind, "layers": list(g.layers),
                        "page_shape": list(g.spec.page_shape), "dtype": g.spec.dtype}
                       for g in self.groups],
            "order": "group-major[group][layer][page]",
        }

