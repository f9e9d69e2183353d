"""Compile the Triton attention kernels for an NVIDIA GPU that is not here (sm_90 by default).

The interpreter runs the kernels' arithmetic but not Triton's compiler, which is stricter (dot
shapes and dtypes, constexpr branches, layouts) and is what a GPU runs. This script runs the
Triton backend's ``forward`` on CPU tensors with every kernel launch replaced by a compile of
that launch, specialised the way a real launch would be (Triton's own argument specialisation:
ints equal to 1 become constants, 16-byte-aligned pointers and ints are marked divisible), through
ptxas to a cubin. Nothing is executed. Run in a process where ``TRITON_INTERPRET`` is unset
(``triton.jit`` reads it at definition time):

    env -u TRITON_INTERPRET .venv/bin/python tests/kernels/triton_compile_check.py [arch]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class CompileInsteadOfLaunch:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` compiles, once per signature."""

    def __init__(self, fn, target, compiled: list[str]) -> None:
        self.fn, self.target, self.compiled, self.seen = fn, target, compiled, set()

    def __getitem__(self, grid):
        return self.compile

    def compile(self, *args, num_warps: int = 4, num_stages: int = 3, **kwargs) -> None:
        import triton
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
        from triton.compiler import ASTSource

        bound = dict(zip(self.fn.arg_names, args)) | kwargs
        signature, constexprs, attrs = {}, {}, {}
        for i, (name, param) in enumerate(zip(self.fn.arg_names, self.fn.params)):
            value = bound[name]
            kind, spec = ("constexpr", None) if param.is_constexpr else native_specialize_impl(
                BaseBackend, value, False, True, True)
            signature[name] = kind
            if kind == "constexpr":
                constexprs[name] = value if param.is_constexpr else spec
            elif spec == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
        key = (tuple(signature.values()), tuple(sorted(constexprs.items())), tuple(attrs), num_warps)
        if key in self.seen:
            return
        self.seen.add(key)
        triton.compile(ASTSource(self.fn, signature, constexprs, attrs), target=self.target,
                       options={"num_warps": num_warps, "num_stages": num_stages})
        shown = {k: v for k, v in constexprs.items() if k.startswith(("BLOCK", "SPLIT"))}
        self.compiled.append(f"{self.fn.__name__}[{signature[self.fn.arg_names[0]]}] {shown}")


def main(arch: int = 90) -> list[str]:
    """Compile every kernel variant a few representative steps launch; returns their names."""
    from triton.backends.compiler import GPUTarget

    from openinfer.attention.triton import TritonAttentionBackend
    from openinfer.kernels import triton_attention as kernels

    assert not kernels.interpreted(), "run without TRITON_INTERPRET=1"
    compiled: list[str] = []
    target = GPUTarget("cuda", arch, 32)
    for name in ("_write_kv_kernel", "_attention_kernel", "_merge_splits_kernel"):
        setattr(kernels, name, CompileInsteadOfLaunch(getattr(kernels, name), target, compiled))
    # (dtype, cache dtype, q heads, kv heads, head_dim, forced decode splits)
    for dtype, cache_dtype, heads, kv_heads, head_dim, splits in (
            (torch.bfloat16, torch.bfloat16, 16, 8, 128, 2),
            (torch.float32, torch.float32, 6, 2, 80, None),
            (torch.bfloat16, torch.float8_e4m3fn, 16, 8, 128, 2)):  # --kv-cache-dtype fp8
        backend = TritonAttentionBackend(num_kv_splits=splits)
        query_lens, seq_lens = [1, 1, 40], [100, 200, 60]
        tables = [list(range(i * 13, (i + 1) * 13)) for i in range(3)]
        meta = backend.build_metadata(query_lens, seq_lens, tables, 16, "cpu")
        pool = torch.zeros(40, 2, 2, 16, kv_heads, head_dim, dtype=cache_dtype)
        qkv = torch.zeros(sum(query_lens), heads + 2 * kv_heads, head_dim, dtype=dtype)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], 1)
        backend.forward(q, k, v, pool[:, 1].transpose(0, 1), meta, head_dim ** -0.5, k_scale=0.5,
                        v_scale=2.0)
    return compiled


if __name__ == "__main__":
    for line in main(int(sys.argv[1]) if len(sys.argv) > 1 else 90):
        print("compiled", line)
