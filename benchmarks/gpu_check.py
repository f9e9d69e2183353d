"""Triton paged attention against the torch reference backend on a GPU: parity and speed.

Per shape, both backends run ``forward`` (KV write + attention, what a layer calls) on the same
engine-like cache (a layer view of a block-major ``[num_blocks, layers, 2, bs, H, D]`` pool with
shuffled blocks), with the step's metadata built outside the timed region, as the engine
builds it once per step for every layer. Qwen3-0.6B-like heads: 16 query heads, 8 KV heads,
head_dim 128, bf16, block size 16.

- decode: ``batch`` sequences of one new token after ``context - 1`` cached ones;
- prefill: ``batch`` fresh prompts of ``context`` tokens;
- chunk: one 512-token chunk after ``context - 512`` cached tokens (a prefix hit or a
  chunked-prefill continuation).

Prints a markdown table (GPU, commit, versions, milliseconds per call, torch / triton) and
exits 1 if any output differs from the reference beyond bf16 tolerance. Called by
``benchmarks/gpu_check.sh``; on a CPU it runs only with ``TRITON_INTERPRET=1 ... --quick``
(tiny shapes through Triton's interpreter: a check of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 16, 8, 128, 16, torch.bfloat16
TOLERANCE = 2e-2


@dataclass
class Shape:
    phase: str
    batch: int
    context: int

    def lengths(self) -> tuple[list[int], list[int]]:
        """(query lens, seq lens) of the step."""
        if self.phase == "decode":
            return [1] * self.batch, [self.context] * self.batch
        if self.phase == "prefill":
            return [self.context] * self.batch, [self.context] * self.batch
        chunk = min(512, self.context // 2)
        return [chunk] * self.batch, [self.context] * self.batch


FULL = [Shape(phase, batch, context) for phase in ("decode", "prefill") for batch in (1, 32)
        for context in (512, 4096)] + [Shape("chunk", 1, 4096)]
QUICK = [Shape("decode", 2, 40), Shape("prefill", 1, 24), Shape("chunk", 1, 40)]


def make_step(shape: Shape, device: torch.device, seed: int = 0):
    """A cache holding every sequence's earlier K/V, the step's q/k/v and its block tables."""
    gen = torch.Generator(device=device).manual_seed(seed)
    query_lens, seq_lens = shape.lengths()
    per_seq = -(-shape.context // BLOCK_SIZE)
    num_blocks = shape.batch * per_seq
    order = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    tables = [order[b * per_seq:(b + 1) * per_seq] for b in range(shape.batch)]
    pool = torch.randn(num_blocks, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen,
                       device=device, dtype=DTYPE)
    cache = pool[:, 0].transpose(0, 1)  # layer 0's strided view, as the engine hands it out
    tokens = sum(query_lens)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen, device=device,
                      dtype=DTYPE)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    q, k, v = (t.view(tokens, -1, HEAD_DIM) for t in (q, k, v))
    return query_lens, seq_lens, tables, cache, q, k, v


def time_call(fn: Callable[[], object], device: torch.device, budget_s: float = 0.3) -> float:
    """Median milliseconds of ``fn`` over repeats filling ~budget_s (after warm-up)."""
    for _ in range(2):
        fn()
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def run_shape(shape: Shape, device: torch.device) -> tuple[float, float, float]:
    """(torch ms, triton ms, max |triton - torch|) for one shape."""
    from openinfer.attention.reference import TorchAttentionBackend
    from openinfer.attention.triton import TritonAttentionBackend

    query_lens, seq_lens, tables, cache, q, k, v = make_step(shape, device)
    scale = HEAD_DIM ** -0.5
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        meta = backend.build_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, device)
        call = lambda backend=backend, meta=meta: backend.forward(q, k, v, cache, meta, scale)
        out = call()  # both write the same K/V into the same slots: the cache can be shared
        results.append((out, time_call(call, device)))
    (ref, ref_ms), (out, tri_ms) = results
    return ref_ms, tri_ms, (out.float() - ref.float()).abs().max().item()


def header(device: torch.device, commit: str) -> list[str]:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    return [f"GPU: {name}  ", f"commit: {commit}  ",
            f"torch {torch.__version__}, triton {triton.__version__}; "
            f"{HEADS} q heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, {str(DTYPE)[6:]}, "
            f"block size {BLOCK_SIZE}", "",
            "| phase | batch | context | torch ms | triton ms | torch / triton | max abs diff |",
            "|---|---:|---:|---:|---:|---:|---:|"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a check of the script)")
    parser.add_argument("--commit", default=os.environ.get("OPENINFER_COMMIT", "unknown"))
    args = parser.parse_args()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interpret:
        print("gpu_check.py: no CUDA device here; skipping the Triton timings "
              "(TRITON_INTERPRET=1 with --quick runs tiny shapes through the interpreter)")
        return 0
    device = torch.device("cpu" if interpret else "cuda")
    print("\n".join(header(device, args.commit)), flush=True)
    failed = []
    for shape in QUICK if args.quick or interpret else FULL:
        ref_ms, tri_ms, diff = run_shape(shape, device)
        mark = "" if diff <= TOLERANCE else " **FAIL**"
        print(f"| {shape.phase} | {shape.batch} | {shape.context} | {ref_ms:.3f} | {tri_ms:.3f} "
              f"| {ref_ms / tri_ms:.2f}x | {diff:.2e}{mark} |", flush=True)
        if mark:
            failed.append(shape)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if failed:
        print(f"\ngpu_check.py: PARITY FAILED for {len(failed)} shape(s): {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
