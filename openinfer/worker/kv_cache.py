"""The KV cache's tensors: one per layer group, and each layer's view of its group's.

A group's tensor is block-major, ``[num_blocks, layers, *page_shape]``: one block of every
layer of the group is one contiguous chunk, so moving a block to the host, a file or
another instance is one copy per group, not one per layer. All groups' tensors are views of
one buffer of ``num_blocks`` pages (the KV manager's one pool: a page serves whichever group
holds its block id)::

    buffer  [ page 0 | page 1 | page 2 | ... ]      page = the largest group's block bytes
    group 0   [0, layers, 2, bs, H, D] ...           (a view; row stride = page)
    group 1   [0, layers, 2, bs, H, D] ...
"""

from __future__ import annotations

import torch

from openinfer.kv.spec import LayerGroup, page_bytes


def allocate_caches(groups: list[LayerGroup], num_blocks: int,
                    device: torch.device | str) -> list[torch.Tensor]:
    """Every group's cache, views of one zero-filled buffer of ``num_blocks`` pages."""
    if len(groups) == 1:
        return [allocate_group_cache(groups[0], num_blocks, device)]
    page = page_bytes(groups)
    buffer = torch.zeros(num_blocks, page, dtype=torch.uint8, device=device)
    caches = []
    for group in groups:
        dtype = getattr(torch, group.spec.dtype)
        part = buffer[:, :group.bytes_per_block].view(dtype)
        caches.append(part.view(num_blocks, len(group.layers), *group.spec.page_shape))
    return caches


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
    MLA latent: ``[num_blocks, block_size, latent + rope]``; compressed: ``[num_blocks,
    entries per page, entry_dim]``."""
    if group.spec.kind in ("full_attention", "sliding_window"):
        # K = V layers store one copy: both halves of the view are it (stride 0).
        return [cache[:, i].transpose(0, 1).expand(2, *cache.shape[:1], *cache.shape[3:])
                for i in range(len(group.layers))]
    if group.spec.kind in ("mla_latent", "compressed"):
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
