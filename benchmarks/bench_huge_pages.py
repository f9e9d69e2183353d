"""Huge pages for tensors (openinfer/huge_pages.py) on vs off, on the peers' W1 shapes.

torch reads ``THP_MEM_ALLOC_ENABLE`` once per process, so each measurement is a child
process run with it set to 1 or 0; the two settings alternate round by round, so that the
machine's drift hits both alike. Each child measures:

    attention   one paged decode attention call (the CPU kernel), 32 sequences x 320 keys,
                8 KV heads of 64, over one layer of a 16-layer block-major cache (670 MiB)
    prefill     32 prompts x 256 tokens through ``openinfer.LLM`` (the peers' W1 prefill)
    decode      the following batch-32 decode steps, per step

    .venv/bin/python benchmarks/bench_huge_pages.py [--model DIR] [--rounds 2] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS_MODEL = Path("/root/.cache/openinfer-peers/models/qwen3-0.4b-random-fp32")
PARTS = ("attention", "prefill", "decode")


def child(model: str, decode_steps: int) -> dict[str, float]:
    import torch

    from openinfer import LLM, SamplingParams
    from openinfer.huge_pages import huge_pages_in_use

    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_attention as ba

    ba.load_cpu_attention()
    setup = ba.Setup(ba.Case("W1 decode", [1] * 32, [320] * 32, 0), 64, torch.float32, 16)
    setup.kernel()
    attention = min(ba.timed(setup.kernel, 0.3) for _ in range(5))
    del setup

    llm = LLM(model, dtype="float32", max_model_len=2048, seed=0, max_num_seqs=32,
              max_num_batched_tokens=4096, kv_cache_memory=4 << 30, progress=False)
    rng = random.Random(0)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 4, ignore_eos=True)
    warm = [[rng.randrange(100, 20000) for _ in range(64)] for _ in range(4)]
    llm.generate([{"prompt_token_ids": p} for p in warm],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for i in range(32):
        engine.add_request(f"r{i}", [rng.randrange(100, 20000) for _ in range(256)], params)
    start = time.perf_counter()
    requests = engine.core.scheduler.requests.values
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests()):
        engine.step()
    prefill = time.perf_counter() - start
    engine.step()
    start = time.perf_counter()
    for _ in range(decode_steps):
        engine.step()
    decode = (time.perf_counter() - start) / decode_steps
    return {"attention": attention, "prefill": prefill, "decode": decode,
            "huge_pages": huge_pages_in_use()}


def run_child(model: str, decode_steps: int, thp: str) -> dict[str, float]:
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE=thp, OPENINFER_CONFIGURE_LOGGING="0")
    out = subprocess.run([sys.executable, __file__, "--child", "--model", model,
                          "--decode-steps", str(decode_steps)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(PEERS_MODEL) if PEERS_MODEL.exists() else None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        sys.exit("--model: no checkpoint given and the peers checkpoint is absent")
    if args.child:
        print(json.dumps(child(args.model, args.decode_steps)))
        return

    from doc_sections import write_section

    runs: dict[str, list[dict[str, float]]] = {"1": [], "0": []}
    for r in range(args.rounds):
        for thp in ("1", "0") if r % 2 == 0 else ("0", "1"):
            result = run_child(args.model, args.decode_steps, thp)
            print(f"round {r + 1}, THP_MEM_ALLOC_ENABLE={thp}: {result}", flush=True)
            runs[thp].append(result)
    assert all(x["huge_pages"] for x in runs["1"]) and not any(x["huge_pages"] for x in runs["0"]), \
        "huge pages were not on and off as asked (kernel THP mode?)"
    scale = {"attention": 1e3, "prefill": 1.0, "decode": 1e3}
    unit = {"attention": "ms per call", "prefill": "s", "decode": "ms per step"}
    rows = []
    for part in PARTS:
        on = [x[part] for x in runs["1"]]
        off = [x[part] for x in runs["0"]]
        ratios = [b / a for a, b in zip(on, off)]
        rows.append(f"| {part} ({unit[part]}) | {statistics.median(off) * scale[part]:.2f} | "
                    f"{statistics.median(on) * scale[part]:.2f} | {statistics.median(ratios):.2f}x "
                    f"[{min(ratios):.2f}, {max(ratios):.2f}] |")
    body = "\n".join([
        "## Huge pages for tensors (benchmarks/bench_huge_pages.py)",
        "",
        f"`THP_MEM_ALLOC_ENABLE` off vs on (openinfer's default), {args.rounds} alternating rounds of "
        f"one process each, model `{Path(args.model).name}` in float32. Attention: one decode call, "
        "32 x 320 keys over a 16-layer cache; prefill: 32 x 256-token prompts; decode: batch 32, "
        f"{args.decode_steps} steps. Speedup = off / on per round, median [min, max].",
        "",
        "| part | off | on | speedup |",
        "|---|---|---|---|",
        *rows,
    ])
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_huge_pages", body)


if __name__ == "__main__":
    main()
