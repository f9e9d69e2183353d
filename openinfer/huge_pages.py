"""Transparent huge pages for torch's large CPU tensors (weights, KV cache, activations).

With 4 KiB pages, a step that streams a gigabyte of weights and hundreds of megabytes of KV
blocks, or multiplies 4096-token activations, spends a good share of its memory accesses
walking page tables: the TLBs cover a few MiB. torch's CPU allocator can back every
allocation of 2 MiB or more with 2 MiB pages (aligned, ``madvise(MADV_HUGEPAGE)``), but only
when ``THP_MEM_ALLOC_ENABLE=1`` is in the environment at its first allocation: PyTorch's own
CPU tuning guide recommends it and leaves it off by default. openinfer turns it on at import
(``request_huge_pages``), before it has allocated anything, unless the variable is already
set (``THP_MEM_ALLOC_ENABLE=0`` keeps it off). Measured on 2 Zen 3 cores
(benchmarks/bench_huge_pages.py, docs/benchmarks.md): the paged decode attention kernel
1.47x faster over a 670 MiB cache, a 32 x 256-token prefill 1.11x; batch-32 decode steps
within the noise. A process that allocated tensors before importing openinfer
keeps its 4 KiB pages; ``huge_pages_in_use`` tells which case holds.
"""

from __future__ import annotations

import os
from pathlib import Path

THP_ENV = "THP_MEM_ALLOC_ENABLE"
HUGE_PAGE_BYTES = 2 << 20
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def request_huge_pages() -> None:
    """Ask torch's allocator for huge pages, unless the user already decided."""
    os.environ.setdefault(THP_ENV, "1")


def system_mode() -> str:
    """The kernel's THP mode (``always``, ``madvise``, ``never``), or ``unavailable``."""
    try:
        text = THP_MODE_FILE.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def _thp_eligible(address: int) -> bool | None:
    """Whether the mapping holding ``address`` may be backed by huge pages (/proc/self/smaps's
    THPeligible: in madvise mode, only a range the allocator advised), if readable."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


def huge_pages_in_use() -> bool:
    """Whether large CPU tensors get huge pages in this process: the mapping of a fresh
    8 MiB tensor must be eligible for them."""
    import torch

    mode = system_mode()
    if mode not in ("always", "madvise"):
        return False
    probe = torch.empty(4 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    # An address past the first huge page lies inside the allocator's advised, aligned range.
    return bool(_thp_eligible(probe.data_ptr() + 2 * HUGE_PAGE_BYTES))
