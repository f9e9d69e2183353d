"""What each layer stores per token, and how layers group into block tables.

Layers with the same spec share one block table per request (a *layer group*).
The scheduler and KV manager only see groups and block counts, so a new kind of
layer (MLA latent, sliding window) is a new spec class, not a scheduler change.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class FullAttentionSpec:
    """Standard (MHA/GQA) attention: a K and a V vector per KV head per token."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def bytes_per_block(self) -> int:
        """Bytes one layer of this spec needs for one block."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a request with ``num_tokens`` tokens holds in a layer of this spec."""
        return -(-num_tokens // self.block_size)


KVSpec = FullAttentionSpec  # the union grows as layer kinds are added


@dataclass(frozen=True)
class LayerGroup:
    spec: KVSpec
    layers: tuple[int, ...]
    """Model layer indices that share this group's block table."""

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block * len(self.layers)


def group_layers(specs: list[KVSpec]) -> list[LayerGroup]:
    """Group layers with identical specs, in order of first appearance."""
    groups: dict[KVSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        groups.setdefault(spec, []).append(layer)
    return [LayerGroup(spec, tuple(layers)) for spec, layers in groups.items()]
