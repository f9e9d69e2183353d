"""The CPU paged attention kernel against today's torch path, on the peers benchmark model's shapes.

Per layer call, timed in the same run, interleaved and repeated:

- ``kernel``: `openinfer.kernels.cpu_attention.paged_attention`, one call for the whole batch,
  reading K/V blocks in place;
- ``reference``: what `openinfer/layers/attention.py` does today (without the K/V write, which
  both paths share): `decode_attention` over gathered, padded, masked KV for the decodes, then
  per prefill either SDPA over the chunk's own K/V (nothing cached) or `gather_kv` +
  `prefill_attention`.

Both read one layer of an engine-like block-major cache ``[num_blocks, layers, 2, bs, H, D]``.
Per-step metadata (masks, tables) is built outside the timed region for both.

    .venv/bin/python benchmarks/bench_attention.py            # every case, fp32 and bf16
    .venv/bin/python benchmarks/bench_attention.py --quick    # fewer repeats
    .venv/bin/python benchmarks/bench_attention.py --bf16-paths

``--bf16-paths``: for a bf16 cache, the kernel's product paths on this CPU side by side
(``fp32``: K/V widened for fp32 FMAs, the baseline; ``avx512_bf16``: VDPBF16PS; ``amx_bf16``:
AMX tiles), interleaved, each path's speedup over ``fp32``.

``--two-pass``: for a bf16 cache, the two-pass items (``run_item_two_pass``) of the
``avx512_bf16`` and ``amx_bf16`` paths against the online softmax they replace, on a twin build
of the kernel without them (``-DOI_ONLINE_ONLY``), interleaved, prefill cases only.

``--read-through``: decode cases as in the engine's forward pass: one call per layer of the
cache in turn, each after a pass over that layer's weights (``--weight-mib``, read as the
GEMMs read them), so that the whole cycle outgrows the CPU's caches and the K/V comes from
memory; against a twin build without the few-row items' plain pass over each chunk's K/V rows
(``-DOI_NO_READ_THROUGH``), interleaved.
"""

from __future__ import annotations

import argparse
import functools
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openinfer.kernels.cpu_attention import (  # noqa: E402
    bf16_dot_paths,
    build_extension,
    load_cpu_attention,
    paged_attention,
)
from openinfer.kernels.paged_attention import (  # noqa: E402
    decode_attention,
    gather_kv,
    prefill_attention,
)

HEADS, KV_HEADS, BLOCK = 16, 8, 16


@dataclass
class Case:
    name: str
    query_lens: list[int]
    seq_lens: list[int]
    shared_prefix: int
    """Leading tokens whose blocks every sequence shares (a prefix-cache hit)."""


def cases() -> list[Case]:
    w3_decode = [1024 + 64 + i * 16 // 31 for i in range(32)]  # 64..80 own tokens
    return [
        Case("W3 decode 32x(1024+64..80)", [1] * 32, w3_decode, 1024),
        Case("W1 decode 32x320", [1] * 32, [320] * 32, 0),
        Case("W3 prefill 32x64 over 1024 cached", [64] * 32, [1024 + 64] * 32, 1024),
        Case("W1 prefill 8x256, no cache", [256] * 8, [256] * 8, 0),
        Case("W2 prefill 1x512, no cache", [512], [512], 0),
        Case("decode 1x512", [1], [512], 0),
        Case("decode 1x2048", [1], [2048], 0),
    ]


def block_tables(case: Case) -> tuple[list[list[int]], int]:
    """Physical blocks: the shared prefix's first, then each sequence's own (shuffled)."""
    shared = case.shared_prefix // BLOCK
    own = [-(-s // BLOCK) - shared for s in case.seq_lens]
    total = shared + sum(own)
    perm = torch.randperm(total).tolist()
    tables, nxt = [], shared
    for n in own:
        tables.append(perm[:shared] + perm[nxt:nxt + n])
        nxt += n
    return tables, total


class Setup:
    def __init__(self, case: Case, head_dim: int, dtype: torch.dtype, layers: int) -> None:
        tables, num_blocks = block_tables(case)
        blocks = torch.randn(num_blocks, layers, 2, BLOCK, KV_HEADS, head_dim, dtype=dtype)
        self.blocks = blocks
        self.cache = self.layer_cache(layers // 2)
        self.case, self.scale = case, 1 / math.sqrt(head_dim)
        tokens = sum(case.query_lens)
        self.q = torch.randn(tokens, HEADS, head_dim, dtype=dtype)
        self.out = torch.empty_like(self.q)
        lens = torch.tensor(case.query_lens)
        self.qsl = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()])
        self.seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
        width = max(len(t) for t in tables)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        # The reference's metadata (layers/attention.py: build_attention_metadata).
        nd = sum(1 for n in case.query_lens if n == 1) if all(n == 1 for n in case.query_lens) else 0
        self.num_decodes = nd
        self.decode_tables = self.tables[:nd].long()
        positions = torch.arange(width * BLOCK)
        self.decode_mask = (positions[None, :] < self.seq_lens[:nd, None])[:, None, None, :]
        self.prefill_tables = [torch.tensor(t, dtype=torch.long) for t in tables[nd:]]
        # What the layer has in hand for a prefill with nothing cached: the chunk's own K/V.
        self.fresh = [gather_kv(self.cache, t, s) for t, s in
                      zip(self.prefill_tables, case.seq_lens[nd:])]

    def layer_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s [2, nb, bs, H, D] view of the cache, as layer_views makes it."""
        return self.blocks[:, layer].transpose(0, 1)

    def kernel(self, bf16_dot: str | None = None) -> None:
        paged_attention(self.out, self.q, self.cache[0], self.cache[1], self.tables, self.qsl,
                        self.seq_lens, self.scale, max(self.case.query_lens), bf16_dot=bf16_dot)

    def reference(self) -> torch.Tensor:
        out, nd = torch.empty_like(self.q), self.num_decodes
        if nd:
            out[:nd] = decode_attention(self.q[:nd], self.cache, self.decode_tables, self.decode_mask,
                                        self.scale)
        starts = self.qsl.tolist()
        for i, (n, s) in enumerate(zip(self.case.query_lens[nd:], self.case.seq_lens[nd:])):
            start = starts[nd + i]
            if s == n:
                k, v = self.fresh[i]
            else:
                k, v = gather_kv(self.cache, self.prefill_tables[i], s)
            out[start:start + n] = prefill_attention(self.q[start:start + n], k, v, self.scale)
        return out


def spread(ratios: list[float]) -> str:
    """Interleaved rounds' speedups as the tables print them: median [min, max]."""
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"


def timed(fn, min_seconds: float) -> float:
    """Mean wall seconds per call over at least ``min_seconds``."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls


def fork_join_ms(threads: int) -> float:
    """Median ms of a small parallel torch op on ``threads`` threads: on a shared machine whose
    cores are busy, a parallel region waits for a time slice, and every figure includes that."""
    x, times = torch.ones(1 << 20), []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    for _ in range(21):
        start = time.perf_counter()
        x.add_(1)
        times.append(time.perf_counter() - start)
    torch.set_num_threads(previous)
    return statistics.median(times) * 1e3


def stall_note(threads: int, when: str) -> str:
    return (f"# a 1M-element add_: {fork_join_ms(1):.3f} ms on 1 thread, {fork_join_ms(threads):.3f} ms "
            f"on {threads} ({when} the run)")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved kernel/reference rounds")
    parser.add_argument("--min-seconds", type=float, default=0.2, help="per timing")
    parser.add_argument("--layers", type=int, default=28, help="layers in the block-major cache")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 0.05 s")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--bf16-paths", action="store_true",
                        help="bf16 only: each product path of the kernel against its fp32 path")
    parser.add_argument("--two-pass", action="store_true",
                        help="bf16: two-pass items against the online path (a twin build)")
    parser.add_argument("--read-through", action="store_true",
                        help="decode from memory: the K/V read-through pass against a twin "
                             "build without it")
    parser.add_argument("--weight-mib", type=int, default=24,
                        help="--read-through: a layer's weights, read before its call (the peers "
                             "model's layers hold 24 MiB in bf16)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.min_seconds = 3, 0.05
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    module = load_cpu_attention()
    if module is None:
        sys.exit("the kernel could not be built")
    print(f"# CPU: {cpu_model()}; torch {torch.__version__} capability "
          f"{torch.backends.cpu.get_cpu_capability()}; kernel build {module.isa()}; "
          f"{args.threads} threads; {args.repeats} interleaved rounds")
    print(stall_note(args.threads, "before"))
    if args.read_through:
        compare_read_through(args, module)
        print(stall_note(args.threads, "after"))
        return
    if args.two_pass:
        compare_two_pass(args, module)
        print(stall_note(args.threads, "after"))
        return
    if args.bf16_paths:
        compare_bf16_paths(args)
        print(stall_note(args.threads, "after"))
        return
    print("| case | head_dim | dtype | kernel ms | reference ms | speedup median [min, max] |")
    print("|---|---|---|---|---|---|")
    for case in cases():
        if args.only not in case.name:
            continue
        for head_dim in (64, 128):
            for dtype in (torch.float32, torch.bfloat16):
                setup = Setup(case, head_dim, dtype, args.layers)
                setup.kernel()
                ref = setup.reference()
                err = (setup.out.float() - ref.float()).abs().max().item()
                assert err < (1e-4 if dtype == torch.float32 else 3e-2), f"{case.name}: max err {err}"
                ks, rs = [], []
                for _ in range(args.repeats):
                    ks.append(timed(setup.kernel, args.min_seconds))
                    rs.append(timed(setup.reference, args.min_seconds))
                ratios = [r / k for k, r in zip(ks, rs)]
                print(f"| {case.name} | {head_dim} | {str(dtype).removeprefix('torch.')} | "
                      f"{statistics.median(ks) * 1e3:.3f} | {statistics.median(rs) * 1e3:.3f} | "
                      f"{spread(ratios)} |",
                      flush=True)
    print(stall_note(args.threads, "after"))


def compare_bf16_paths(args: argparse.Namespace) -> None:
    paths = bf16_dot_paths()
    print(f"| case | head_dim | {' | '.join(f'{p} ms' for p in paths)} | "
          f"{' | '.join(f'{p} / fp32' for p in paths[1:])} |")
    print("|---|---|" + "---|" * (2 * len(paths) - 1))
    for case in cases():
        if args.only not in case.name:
            continue
        for head_dim in (64, 128):
            setup = Setup(case, head_dim, torch.bfloat16, args.layers)
            ref = setup.reference().float()
            for path in paths:
                setup.kernel(path)
                err = (setup.out.float() - ref).abs().max().item()
                assert err < 3e-2, f"{case.name} {path}: max err {err}"
            times: dict[str, list[float]] = {p: [] for p in paths}
            for _ in range(args.repeats):
                for path in paths:
                    times[path].append(timed(functools.partial(setup.kernel, path), args.min_seconds))
            ms = [f"{statistics.median(times[p]) * 1e3:.3f}" for p in paths]
            ratios = []
            for path in paths[1:]:
                r = [f / t for f, t in zip(times["fp32"], times[path])]
                ratios.append(spread(r))
            print(f"| {case.name} | {head_dim} | {' | '.join(ms)} | {' | '.join(ratios)} |", flush=True)


def compare_two_pass(args: argparse.Namespace, module) -> None:
    paths = [p for p in bf16_dot_paths() if p != "fp32"]
    if not paths:
        sys.exit("this CPU/build has no bf16 dot-product path")
    online = build_extension(("-DOI_ONLINE_ONLY",), "online")
    print("| case | head_dim | path | two-pass ms | online ms | two-pass speedup median [min, max] |")
    print("|---|---|---|---|---|---|")
    for case in cases():
        if args.only not in case.name or "prefill" not in case.name:
            continue
        for head_dim in (64, 128):
            setup = Setup(case, head_dim, torch.bfloat16, args.layers)
            ref = setup.reference().float()
            for path in paths:
                calls = {}
                for name, build in (("two-pass", module), ("online", online)):
                    calls[name] = functools.partial(
                        build.paged_attention, setup.out, setup.q, setup.cache[0], setup.cache[1],
                        setup.tables, setup.qsl, setup.seq_lens, setup.scale, max(case.query_lens),
                        invariant=False, window=0, softcap=0.0, sinks=None, bf16_dot=path)
                    calls[name]()
                    err = (setup.out.float() - ref).abs().max().item()
                    assert err < 3e-2, f"{case.name} {path} {name}: max err {err}"
                times: dict[str, list[float]] = {name: [] for name in calls}
                for _ in range(args.repeats):
                    for name, call in calls.items():
                        times[name].append(timed(call, args.min_seconds))
                r = [o / t for t, o in zip(times["two-pass"], times["online"])]
                print(f"| {case.name} | {head_dim} | {path} | "
                      f"{statistics.median(times['two-pass']) * 1e3:.3f} | "
                      f"{statistics.median(times['online']) * 1e3:.3f} | "
                      f"{spread(r)} |", flush=True)


def compare_read_through(args: argparse.Namespace, module) -> None:
    plain = build_extension(("-DOI_NO_READ_THROUGH",), "no_read_through")
    weights = [torch.ones(args.weight_mib << 18) for _ in range(args.layers)]  # float32 values

    def forward_pass(call) -> float:
        """Seconds per attention call over one pass of the layers, each call after a read of
        its layer's weights."""
        total = 0.0
        for layer, weight in enumerate(weights):
            weight.sum()
            total -= time.perf_counter()
            call(layer)
            total += time.perf_counter()
        return total / len(weights)

    print(f"{args.layers} layers of {args.weight_mib} MiB of weights")
    print("| case | head_dim | dtype | read-through ms | without ms | speedup median [min, max] |")
    print("|---|---|---|---|---|---|")
    for case in cases():
        if args.only not in case.name or "decode" not in case.name:
            continue
        for head_dim in (64, 128):
            for dtype in (torch.float32, torch.bfloat16):
                setup = Setup(case, head_dim, dtype, args.layers)
                ref = setup.reference().float()
                calls = {}
                for name, build in (("read-through", module), ("without", plain)):
                    calls[name] = call = functools.partial(decode_on_layer, build, setup)
                    call(args.layers // 2)
                    err = (setup.out.float() - ref).abs().max().item()
                    assert err < (1e-4 if dtype == torch.float32 else 3e-2), f"{case.name} {name}: {err}"
                times: dict[str, list[float]] = {name: [] for name in calls}
                for _ in range(args.repeats):
                    for name, call in calls.items():
                        times[name].append(min(forward_pass(call) for _ in range(3)))
                r = [w / t for t, w in zip(times["read-through"], times["without"])]
                print(f"| {case.name} | {head_dim} | {str(dtype).removeprefix('torch.')} | "
                      f"{statistics.median(times['read-through']) * 1e3:.3f} | "
                      f"{statistics.median(times['without']) * 1e3:.3f} | "
                      f"{spread(r)} |", flush=True)


def decode_on_layer(build, setup: Setup, layer: int) -> None:
    """``setup``'s decode batch through kernel build ``build`` on layer ``layer`` of its cache."""
    cache = setup.layer_cache(layer)
    build.paged_attention(setup.out, setup.q, cache[0], cache[1], setup.tables, setup.qsl,
                          setup.seq_lens, setup.scale, 1, invariant=False, window=0,
                          softcap=0.0, sinks=None, bf16_dot="")


if __name__ == "__main__":
    main()
