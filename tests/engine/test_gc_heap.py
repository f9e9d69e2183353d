"""The engine freezes its start-up heap out of the garbage collector's passes, and a later
engine in the same process unfreezes first, so nothing an earlier one left behind is kept."""

from __future__ import annotations

import gc
import weakref

from openinfer import LLM, SamplingParams


class Node:
    """Half of a reference cycle: only the cyclic collector can free it."""

    def __init__(self) -> None:
        self.partner: Node | None = None


def test_engine_freezes_its_heap_and_a_later_engine_releases_earlier_garbage(qwen3_checkpoint):
    gc.unfreeze()
    a, b = Node(), Node()
    a.partner, b.partner = b, a
    alive = weakref.ref(a)
    first = LLM(str(qwen3_checkpoint), max_model_len=128, kv_cache_memory=8 << 20, progress=False)
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # torch, transformers and the model's objects
    gc.collect()
    assert alive() is not None  # frozen with everything else live at start-up
    del a, b  # now garbage, but frozen: no collection frees it
    gc.collect()
    assert alive() is not None
    out = first.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4  # the engine runs with its heap frozen
    second = LLM(str(qwen3_checkpoint), max_model_len=128, kv_cache_memory=8 << 20, progress=False)
    assert alive() is None  # the second engine's start-up collected the first's leftovers
    assert gc.get_freeze_count() > 0
    del first, second
    gc.unfreeze()
