"""Data-parallel expert parallelism: the two ways tokens reach their experts' ranks, timed
at one MoE layer over a range of batch sizes, in one run.

Two gloo ranks (processes), each with its own tokens, hold half the experts each; per batch
size both exchange paths of ``FusedExperts`` run on the same tokens (alternating order):
all-gather + reduce-scatter (every token to every rank) and all-to-all (a token only to
the ranks holding its experts, and back). Reported: time per layer call and bytes each
rank puts into collectives, per path. On a CPU the two ranks share the machine's cores;
on GPUs (``--device cuda``, NCCL) the same script times the usual case.

    .venv/bin/python benchmarks/bench_expert_dispatch.py [--device cpu] [--reps 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time
from pathlib import Path

import torch
from doc_sections import write_section

REPO = Path(__file__).resolve().parent.parent
EXPERTS, HIDDEN, INTER, TOP_K = 16, 1024, 512, 2
BATCHES = (1, 8, 32, 128, 512)


def _rank(rank: int, port: int, device: str, reps: int, results) -> None:
    import torch.distributed as dist

    from openinfer.distributed.parallel_state import COLLECTIVES, ExpertParallel, set_ep
    from openinfer.layers import moe

    torch.set_num_threads(1)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    set_ep(ExpertParallel(rank, 2, True, 0, dist.group.WORLD, across_data_parallel=True))
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    with torch.device(dev):
        layer = moe.FusedExperts(EXPERTS, HIDDEN, INTER)
        layer.w13.data.normal_(0, 0.02)
        layer.w2.data.normal_(0, 0.02)
    rows = []
    g = torch.Generator().manual_seed(rank)
    for batch in BATCHES:
        x = torch.randn(batch, HIDDEN, generator=g).to(dev)
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K]
                           for _ in range(batch)]).to(dev)
        weights = torch.rand(batch, TOP_K, generator=g).to(dev)
        times: dict[str, list[float]] = {"gather": [], "all_to_all": []}
        sent: dict[str, int] = {}
        for rep in range(reps + 2):
            for path in (("gather", "all_to_all") if rep % 2 else ("all_to_all", "gather")):
                threshold = 0 if path == "all_to_all" else 10**9
                moe.ALL_TO_ALL_MIN_TOKENS = dict.fromkeys(("cpu", "cuda"), threshold)
                before = sum(entry[1] for entry in COLLECTIVES.values())
                dist.barrier()
                start = time.perf_counter()
                with torch.inference_mode():
                    layer(x, weights, ids)
                if cuda:
                    torch.cuda.synchronize()
                if rep >= 2:  # two warm-up rounds
                    times[path].append(time.perf_counter() - start)
                sent[path] = sum(entry[1] for entry in COLLECTIVES.values()) - before
        rows.append(dict(batch=batch, gather=statistics.median(times["gather"]),
                         all_to_all=statistics.median(times["all_to_all"]),
                         gather_bytes=sent["gather"], all_to_all_bytes=sent["all_to_all"]))
    results.put((rank, rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args.device, args.reps, results))
             for r in range(2)]
    for p in procs:
        p.start()
    by_rank = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    lines = [
        "## Expert dispatch across data-parallel ranks (benchmarks/bench_expert_dispatch.py)",
        "",
        f"One MoE layer ({EXPERTS} experts of {INTER}, hidden {HIDDEN}, top {TOP_K}, float32) "
        f"over 2 ranks on {args.device} with the same number of tokens each, {args.reps} "
        "calls per path in alternating order (median). Rank 0's time and the bytes it puts "
        "into collectives per call. On a CPU both ranks share the cores, one thread each.",
        "",
        "| tokens per rank | all-gather + reduce-scatter | all-to-all | all-to-all / gather "
        "| bytes (gather) | bytes (all-to-all) |",
        "|---|---|---|---|---|---|",
    ]
    for r in by_rank[0]:
        lines.append(f"| {r['batch']} | {1e3 * r['gather']:.2f} ms | {1e3 * r['all_to_all']:.2f} ms "
                     f"| **{r['all_to_all'] / r['gather']:.2f}** | "
                     f"{r['gather_bytes'] / 1024:.0f} KiB | {r['all_to_all_bytes'] / 1024:.0f} KiB |")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_expert_dispatch", body)


if __name__ == "__main__":
    main()
