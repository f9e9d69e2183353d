"""What this CPU can do, as plain facts that load-time decisions start from.

The machines openinfer runs on change (an AVX2-only Zen 3 one day, a Zen 5 with AVX-512 and
AVX512_BF16 the next), so nothing here hard-codes an answer: ``cpu_flags`` reads the ISA
extensions, and the decisions (``auto_cpu_dtype``) take the flags as an argument, so tests can
pose as any CPU. torch is imported where a function needs it: the scheduler and router import
this module (through openinfer.config) and load no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""Extensions with bf16 dot-product instructions (VDPBF16PS, AMX tiles): with one of them,
bf16 GEMMs run several times faster than fp32; without, ATen converts bf16 element by element
(3.7x slower than fp32 at 32 rows, 5.5x at 512 on an AVX2 Zen 3), and the GEMM plans widen it to
fp32 instead (kernels/gemm_paths.py): a bf16 model then decodes faster than in fp32 (half the
bytes) but prefills slower (0.83-0.88x fp32 on the dense peers model, Zen 3)."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ISA extensions this CPU has, lower case as /proc/cpuinfo spells them (avx2,
    avx512_bf16, amx_bf16, ...): those torch's cpuinfo reports plus /proc/cpuinfo's flags."""
    import torch

    flags: set[str] = set()
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is not None:
        flags.update(name for name, present in get_capabilities().items() if present is True)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
                break
    return frozenset(flags)


def has_native_bf16(flags: Collection[str]) -> bool:
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def cpu_capability() -> str:
    """The vector ISA ATen's CPU kernels dispatch to: DEFAULT, AVX2, AVX512, ..."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def last_level_cache_bytes() -> int | None:
    """The largest CPU cache cpu0 sees (its L3, usually), from sysfs; None where unknown."""
    sizes = []
    for level in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (level / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[-1:] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=None)


@functools.cache
def cpu_model_name() -> str:
    """The CPU's marketing name (as /proc/cpuinfo or cpuinfo gives it), or 'unknown'."""
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    return str(get_capabilities().get("cpu_name", "unknown")) if get_capabilities else "unknown"


def auto_cpu_dtype(checkpoint_dtype: str | None, flags: Collection[str]) -> tuple[torch.dtype, str]:
    """What ``dtype='auto'`` computes in on a CPU with ``flags``, and why (for the log).

    bfloat16 only when the checkpoint is bfloat16 (its config's torch_dtype/dtype) and the CPU
    has native bf16 dot products (``NATIVE_BF16_FLAGS``); float32 otherwise. float16
    checkpoints also run in float32: few CPUs have fast fp16 GEMMs.
    """
    import torch

    name = checkpoint_dtype or "float32"
    if name != "bfloat16":
        return torch.float32, f"the checkpoint is {name}"
    present = [flag for flag in NATIVE_BF16_FLAGS if flag in flags]
    if present:
        return torch.bfloat16, f"bfloat16 checkpoint and the CPU has {'+'.join(present)}"
    return torch.float32, ("bfloat16 checkpoint, but the CPU has no AVX512_BF16 or AMX_BF16: "
                           "bf16 would be widened to fp32 for every product (--dtype bfloat16 "
                           "halves the weights' memory and prefills slower)")
