"""DeepSeek-V4.1 bounded replay (issue 50): prefill tokens/s of one long prompt with the
YOCO consumers computing every row vs only their last rows (exact: the first token and its
logprob are compared), and the share of consumer-layer rows it skipped. A random V4.1 of 8
layers (window, three C2 producers, four C1 consumers sharing two KV sources; hidden 256,
8 heads of 64, window 128, 8 experts top-2), float32, attention in torch per sequence.

    .venv/bin/python benchmarks/bench_v41_replay.py [--no-write] [--lengths 2048,4096,8192]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from doc_sections import write_section

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from v41_checkpoint import build_v41_checkpoint  # noqa: E402

from openinfer.models.v41_replay import REPLAY_ROWS_ENV  # noqa: E402

MODEL = dict(
    num_hidden_layers=8, num_nextn_predict_layers=0, compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1],
    kv_source_layer_ids=[1, 4, 6], index_k_source_layer_ids=[1, 2, 3, 4, 6],
    index_source_layer_ids=[1, 2, 3, 4, 5, 6, 7], candidate_source_layer_id=None,
    engram_layer_ids=[0], engram_vocab_size=1009, hidden_size=256, num_attention_heads=8,
    head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=2, vocab_size=4096,
    max_position_embeddings=32768, sliding_window=128, index_topk=512, index_n_heads=4,
    index_head_dim=32, moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, swiglu_limit=10.0)
CHUNK = 1024


def prefill(path: str, prompt: list[int], rows: str) -> tuple[float, int, float, int]:
    """(seconds, first token, its logprob, consumer rows skipped) of one prompt's prefill."""
    from openinfer import LLM, SamplingParams

    os.environ[REPLAY_ROWS_ENV] = rows
    llm = LLM(path, progress=False, enable_prefix_caching=False, dtype="float32", max_model_len=32768,
              max_num_batched_tokens=CHUNK, kv_cache_memory=4 << 30)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    llm.generate([prompt[:64]], params)  # warm-up
    model = llm.engine.core.executor.worker.model
    model.num_rows_skipped = 0
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0].outputs[0]
    seconds = time.perf_counter() - start
    token = out.token_ids[0]
    skipped = model.num_rows_skipped
    llm.engine.core.shutdown()
    return seconds, token, out.logprobs[0][token].logprob, skipped


def figures(lengths: list[int]) -> str:
    g = torch.Generator().manual_seed(3)
    rows = ["| prompt tokens | every row: s | tokens/s | bounded replay: s | tokens/s | speed-up | "
            "consumer rows skipped | same first token, logprob diff |", "|---|---|---|---|---|---|---|---|"]
    consumers = MODEL["compress_ratios"][:MODEL["num_hidden_layers"]].count(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_v41_checkpoint(Path(tmp) / "v41", release=False, **MODEL))
        for n in lengths:
            prompt = torch.randint(10, 4096, (n,), generator=g).tolist()
            full_s, full_t, full_lp, _ = prefill(path, prompt, "0")
            part_s, part_t, part_lp, skipped = prefill(path, prompt, "")
            rows.append(f"| {n} | {full_s:.2f} | {n / full_s:.0f} | {part_s:.2f} | {n / part_s:.0f} | "
                        f"{full_s / part_s:.2f}x | {skipped / (consumers * n):.0%} | "
                        f"{full_t == part_t}, {abs(full_lp - part_lp):.1e} |")
            print(rows[-1], flush=True)
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--lengths", default="2048,4096,8192,16384")
    args = parser.parse_args()
    table = figures([int(n) for n in args.lengths.split(",")])
    body = f"""## DeepSeek-V4.1 bounded replay (benchmarks/bench_v41_replay.py)

One prompt's prefill ({CHUNK}-token chunks, float32) on a random V4.1 of 8 layers (window,
three C2 producers, four C1 consumers; hidden 256, 8 heads of 64, window 128, index top-512,
8 experts top-2), with the consumers computing every row, then only their last rows (the
last consumer 128, each before it 127 more: 509, 382, 255, 128). The first token and its
logprob are compared: bounded replay here is exact. What it saves is the consumers' share
of the work (attention, MoE, mixing); the C1 entries and index keys of every row are still
made, and the producers run every row. (Engram on layer 0; attention in torch per sequence:
the indexer's scores over every entry dominate long prompts in both runs.)

{table}
"""
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_v41_replay", body)


if __name__ == "__main__":
    main()
