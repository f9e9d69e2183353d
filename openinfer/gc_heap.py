"""Keep Python's cyclic garbage collector off the objects an engine builds at start-up.

Loading a model leaves a few hundred thousand tracked objects (torch, transformers, the
model's modules) that live as long as the process. A full collection walks all of them: 67 ms
on the peers model's engine (2 Intel cores), paid inside whichever step or request happens to
trigger it. vLLM freezes its heap after start-up for the same reason
(`vllm/utils/gc_utils.py: freeze_gc_heap`). ``freeze_heap`` collects once and then moves every
live object to the permanent generation, which collections skip; objects made afterwards are
collected as before.

A process may build several engines (tests, notebooks): each call unfreezes first, so that
what earlier engines left behind in reference cycles is collected rather than kept forever.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_heap(where: str) -> int:
    """Collect, then freeze every live object; returns how many were frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("%s: %d objects frozen out of the garbage collector's passes", where, frozen)
    return frozen
