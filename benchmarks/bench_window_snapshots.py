"""window snapshots figures (issue 15): what window snapshots cost and save.

A random gpt-oss-shaped checkpoint (window and full layers alternating, window 128) built here
with transformers; one 12-turn conversation (each turn: the conversation so far + 96 new
tokens, 32 tokens generated greedily), then 12 "edits" that re-send an earlier point of it with
a new last message (a prefix hit that ends where no snapshot is). Three engines, the same
requests, interleaved turn by turn in one process:

* no prefix caching (full recompute),
* per-block window pages (``--no-window-snapshots``: every window page stays cached),
* window snapshots (window pages cached only at snapshots every 512 tokens and at prompts' and
  requests' last full blocks).

Figures: mean TTFT per phase (ratios to recompute), prompt tokens computed, tokens replayed,
and the window pages the device cache holds per cached token at the end.

    .venv/bin/python benchmarks/bench_window_snapshots.py [--no-write]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

import torch
from doc_sections import write_section

from openinfer import LLM, SamplingParams

REPO = Path(__file__).resolve().parent.parent
CONFIG = dict(vocab_size=4096, hidden_size=512, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, head_dim=64, sliding_window=128,
              layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=8,
              num_experts_per_tok=2, max_position_embeddings=8192)
TURNS, USER_TOKENS, REPLY_TOKENS, INTERVAL = 12, 96, 32, 512


def build_checkpoint(path: str) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.GptOssConfig(**CONFIG, rope_parameters={"rope_type": "default",
                                                                   "rope_theta": 10000.0})
    config.architectures = ["GptOssForCausalLM"]
    transformers.GptOssForCausalLM(config).eval().save_pretrained(path)


def run(path: str) -> str:
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=REPLY_TOKENS, ignore_eos=True)
    common = dict(progress=False, skip_tokenizer_init=True, block_size=16)
    engines = {
        "recompute": LLM(path, enable_prefix_caching=False, **common),
        "per-block window pages": LLM(path, window_snapshots=False, **common),
        "window snapshots": LLM(path, window_snapshot_interval=INTERVAL, **common),
    }
    user = [[rng.randrange(10, 4000) for _ in range(USER_TOKENS)] for _ in range(TURNS)]
    ttft = {name: {"turns": [], "edits": []} for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    conversation: list[int] = []
    points = []
    for turn in range(TURNS):
        prompt = conversation + user[turn]
        points.append(len(conversation) + USER_TOKENS // 2)  # an edit point inside this turn
        for name, llm in engines.items():
            out = llm.generate([prompt], params)[0]
            ttft[name]["turns"].append(out.metrics.time_to_first_token)
            outputs[name].append(out.outputs[0].token_ids)
        reply = outputs["recompute"][-1]
        assert all(o[-1] == reply for o in outputs.values()), "tokens differ between engines"
        conversation = prompt + reply
    for point in points:  # re-send the conversation up to a point, with a new message
        prompt = conversation[:point] + [rng.randrange(10, 4000) for _ in range(16)]
        for name, llm in engines.items():
            out = llm.generate([prompt], params)[0]
            ttft[name]["edits"].append(out.metrics.time_to_first_token)
            outputs[name].append(out.outputs[0].token_ids)
    assert all(o == outputs["recompute"] for o in outputs.values()), "tokens differ between engines"

    rows = ["| engine | turns: mean TTFT ms | vs recompute | edits: mean TTFT ms | vs recompute | "
            "prompt tokens computed | tokens replayed | window-layer bytes cached per cached token |",
            "|---|---|---|---|---|---|---|---|"]
    base = {phase: statistics.mean(ttft["recompute"][phase]) for phase in ("turns", "edits")}
    for name, llm in engines.items():
        stats = llm.engine.core.stats()
        kv = llm.engine.core.kv
        cached_tokens = kv.num_cached_blocks * kv.block_size
        window_bytes = sum(kv.pools[g].num_cached * kv.groups[g].bytes_per_block for g, _ in kv.windows)
        full_bytes = sum(kv.groups[g].bytes_per_block for g in kv.anchors) // kv.block_size
        per_token = (f"{window_bytes / cached_tokens:.0f} B (full layers: {full_bytes} B)"
                     if cached_tokens else "-")
        turns, edits = statistics.mean(ttft[name]["turns"]), statistics.mean(ttft[name]["edits"])
        rows.append(f"| {name} | {turns * 1e3:.1f} | {turns / base['turns']:.2f}x | {edits * 1e3:.1f} | "
                    f"{edits / base['edits']:.2f}x | {stats['prompt_tokens_computed']} | "
                    f"{stats.get('window_replayed_tokens', 0)} | {per_token} |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        build_checkpoint(path)
        table = run(path)
    body = f"""## Window snapshots (benchmarks/bench_window_snapshots.py)

A random gpt-oss-shaped model (4 layers alternating window 128 / full, hidden 512, 8 experts
top-2, float32) on the CPU; one {TURNS}-turn conversation ({USER_TOKENS} new tokens a turn,
{REPLY_TOKENS} generated), then {TURNS} edits that re-send it up to the middle of a turn with
a new 16-token message. The three engines serve the same requests interleaved, and give the
same tokens. TTFT is the engine's (arrival to first token, offline).

{table}

(Window and full layers hold the same bytes per token while a request runs.) Bounded replay
keeps a window page only where a snapshot needs it (every {INTERVAL} tokens and
the last full block of each prompt and each request), so a chat's next turn resumes from the
previous request's last block (no replay); an edit resumes from the latest snapshot behind its
hit and recomputes the rest. Per-block pages hit everywhere but keep every window page.
"""
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_window_snapshots", body)


if __name__ == "__main__":
    main()
