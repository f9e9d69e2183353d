"""A caching allocator for torch's large CPU tensors, in the processes that run a model on CPU.

torch's CPU allocator hands a freed block of a megabyte or more back to the C library, which
returns it to the kernel; the next step's activation of the same shape then faults in fresh,
kernel-zeroed pages. On the VMs these figures come from that costs more than the arithmetic
on the block: a 100 MB gate/up output of a 4096-token float32 prefill took 42 ms to allocate
and fill, 6 ms when reused. The allocator in the CPU extension
(``kernels/cpu/caching_allocator.cpp``) keeps such blocks for the next request of about their
size, as torch's CUDA allocator does on GPUs, and releases the oldest while the kept blocks
exceed a limit: ``OPENINFER_CPU_ALLOCATOR_CACHE`` (bytes, e.g. ``512MiB``; default 2 GiB; ``0``
turns it off). A kept block is memory the process holds while idle: at most the limit, and
in practice the largest step's activations.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

from openinfer.units import env_bytes

logger = logging.getLogger(__name__)

CPU_ALLOCATOR_CACHE_ENV = "OPENINFER_CPU_ALLOCATOR_CACHE"
DEFAULT_CACHE_BYTES = 2 << 30


def cache_limit() -> int:
    """Bytes of freed blocks the allocator may keep; raises ValueError (naming the variable)
    for a malformed OPENINFER_CPU_ALLOCATOR_CACHE."""
    value = env_bytes(CPU_ALLOCATOR_CACHE_ENV)
    return DEFAULT_CACHE_BYTES if value is None else value


@dataclass(frozen=True)
class AllocatorStats:
    hits: int
    """Allocations served from a kept block."""
    misses: int
    """Allocations of 1 MiB or more that found no kept block of their size."""
    cached_bytes: int
    """Bytes kept in freed blocks now."""
    limit_bytes: int
    live_blocks: int
    """Blocks of 1 MiB or more in use."""


def install(kernels: ModuleType | None, limit: int | None = None) -> bool:
    """Make torch's CPU allocator in this process the caching one (kept bytes: ``limit``, else
    ``cache_limit()``); a second call sets the limit. False where the extension is missing,
    the limit is 0 (and it was never installed) or another allocator has precedence."""
    limit = cache_limit() if limit is None else limit
    if kernels is None or (limit == 0 and stats(kernels) is None):
        return False
    if not kernels.install_caching_allocator(limit):
        logger.warning("CPU caching allocator not installed: another CPU allocator has precedence")
        return False
    return True


def stats(kernels: ModuleType) -> AllocatorStats | None:
    """The allocator's counters, or None where it is not installed in this process."""
    values = kernels.caching_allocator_stats()
    return AllocatorStats(*values) if values else None
