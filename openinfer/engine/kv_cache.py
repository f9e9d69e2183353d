"""The KV cache's tensors: one per layer group, and each layer's view of its group's.

A group's tensor is block-major, ``[num_blocks, layers, *page_shape]``: one block of every
layer of the group is one contiguous chunk, so moving a block to the host, a file or
another instance is one copy per group, not one per layer.
"""

from __future__ import annotations

import torch

from openinfer.kv.spec import LayerGroup


def allocate_group_cache(group: LayerGroup, num_blocks: int,
                         device: torch.device | str) -> torch.Tensor:
    """A group's cache, zero-filled: padded block-table entries are read (then masked),
    and garbage there could be NaN, which masking does not cancel."""
    spec = group.spec
    return torch.zeros(num_blocks, len(group.layers), *spec.page_shape,
                       dtype=getattr(torch, spec.dtype), device=device)


def layer_views(group: LayerGroup, cache: torch.Tensor) -> list[torch.Tensor]:
    """Each of the group's layers' cache as its attention takes it, a strided view of the
    block-major tensor. Full and sliding-window attention: ``[K|V, num_blocks, block_size, H, D]``;
    MLA latent: ``[num_blocks, block_size, latent + rope]``."""
    if group.spec.kind in ("full_attention", "sliding_window"):
        return [cache[:, i].transpose(0, 1) for i in range(len(group.layers))]
    if group.spec.kind == "mla_latent":
        return [cache[:, i] for i in range(len(group.layers))]
    raise NotImplementedError(f"no cache view for {group.spec.kind} layers")


def per_layer_views(groups: list[LayerGroup], caches: list[torch.Tensor],
                    num_layers: int) -> list[torch.Tensor | None]:
    """Model layer index -> its cache view (None for a layer without KV)."""
    views: list[torch.Tensor | None] = [None] * num_layers
    for group, cache in zip(groups, caches):
        for layer, view in zip(group.layers, layer_views(group, cache)):
            views[layer] = view
    return views
