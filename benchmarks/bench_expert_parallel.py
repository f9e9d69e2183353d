"""Expert parallelism and EPLB, in one run:

1. EPLB's placement on skewed routing traces (pure Python; DeepSeek-V3's shape: 256 routed
   experts, 8 per token): the max/mean rank load with the experts in checkpoint order
   (what a rank loads) and after ``rebalance``, against the lower bound (the heaviest
   replica alone on a rank), for 8 to 64 ranks with and without redundant slots.
2. One random-weight Qwen3-MoE checkpoint through TP=1, TP=2 (every expert sliced over the
   ranks), TP=2 + EP (whole experts per rank) and TP=2 + EP + EPLB: weights per rank,
   collectives per decode step, decode throughput against TP=1 (same prompts, alternating
   order, greedy tokens checked equal), and what EPLB's rearrangements cost.

3. The hierarchical placement against the global one for ranks on several nodes, on
   traces routed as DeepSeek-V3 routes (8 expert groups, a token's 8 experts within its 4
   best groups): max/mean rank load, and how many nodes a token's experts are spread over
   (the traffic between machines).

On a CPU the ranks share its cores (one torch thread per rank at TP=2, one per core at
TP=1); on GPUs (``--device cuda``, one per rank) the same script times the usual case.

    .venv/bin/python benchmarks/bench_expert_parallel.py [--device cpu] [--reps 3]
    .venv/bin/python benchmarks/bench_expert_parallel.py --hierarchical-only   # part 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from doc_sections import write_section

from openinfer import LLM, SamplingParams
from openinfer.demo import build_demo_tokenizer
from openinfer.distributed.eplb import (
    STICKINESS,
    Placement,
    initial_placement,
    rebalance,
    rebalance_hierarchical,
)

REPO = Path(__file__).resolve().parent.parent
EXPERTS, TOP_K = 16, 2
EPLB = {"window_size": 32, "step_interval": 48, "num_redundant_experts": 2}


def skewed_loads(num_experts: int, top_k: int, tokens: int, exponent: float, layers: int,
                 seed: int) -> list[list[int]]:
    """Tokens per expert in each layer when every token picks ``top_k`` distinct experts
    with Zipf(``exponent``) popularity, the popular experts shuffled per layer."""
    g = torch.Generator().manual_seed(seed)
    zipf = 1 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent
    loads = []
    for _ in range(layers):
        weights = zipf[torch.randperm(num_experts, generator=g)]
        picks = torch.multinomial(weights.expand(tokens, -1), top_k, generator=g)
        loads.append(torch.bincount(picks.flatten(), minlength=num_experts).tolist())
    return loads


def placement_rows() -> list[dict]:
    rows = []
    for exponent in (0.6, 1.0):
        loads = skewed_loads(256, 8, 8192, exponent, layers=8, seed=0)
        for ranks, redundant in ((8, 0), (8, 32), (32, 0), (32, 32), (64, 0), (64, 64)):
            before, after, bound = [], [], []
            moved = {0.0: [], STICKINESS: []}  # on the next window, by packing stickiness
            shifted = {0.0: [], STICKINESS: []}
            for layer, load in enumerate(loads):
                start = initial_placement(256, ranks, redundant)
                placed = rebalance(load, ranks, 256 + redundant, start)
                copies = [len(r) for r in placed.replicas()]
                mean = sum(load) / ranks
                before.append(start.imbalance(load))
                after.append(placed.imbalance(load))
                bound.append(max(1.0, max(w / c for w, c in zip(load, copies)) / mean))
                # The next window: the same skew with ±5% noise per expert.
                g = torch.Generator().manual_seed(layer)
                noisy = [w * (0.95 + 0.1 * float(torch.rand(1, generator=g))) for w in load]
                for stickiness in moved:
                    first = rebalance(load, ranks, 256 + redundant, start, stickiness)
                    second = rebalance(noisy, ranks, 256 + redundant, first, stickiness)
                    moved[stickiness].append(_moved(first, second))
                    shifted[stickiness].append(second.imbalance(noisy))
            rows.append(dict(exponent=exponent, ranks=ranks, redundant=redundant,
                             before=statistics.mean(before), after=statistics.mean(after),
                             bound=statistics.mean(bound),
                             moved={k: statistics.mean(v) for k, v in moved.items()},
                             shifted={k: statistics.mean(v) for k, v in shifted.items()}))
            print(rows[-1], flush=True)
    return rows


def group_limited_traces(tokens: int, exponent: float, layers: int, seed: int
                         ) -> list[list[list[int]]]:
    """Each token's experts in each layer, routed as DeepSeek-V3 routes (256 experts in 8
    groups of 32; a token keeps its 4 best groups, then takes its 8 experts from them),
    with Zipf(``exponent``) expert popularity shuffled per layer."""
    g = torch.Generator().manual_seed(seed)
    zipf = 1 / torch.arange(1, 257, dtype=torch.float64) ** exponent
    traces = []
    for _ in range(layers):
        weights = zipf[torch.randperm(256, generator=g)].view(8, 32)
        groups = torch.multinomial(weights.sum(1).expand(tokens, -1), 4, generator=g)
        allowed = torch.zeros(tokens, 8, 32, dtype=torch.float64)
        allowed.scatter_(1, groups[:, :, None].expand(-1, -1, 32), 1.0)
        picks = torch.multinomial((allowed * weights).view(tokens, 256), 8, generator=g)
        traces.append(picks.tolist())
    return traces


def _nodes_per_token(trace: list[list[int]], placement: Placement, num_nodes: int,
                     seed: int) -> float:
    """Mean distinct nodes a token's experts are on, each expert's tokens spread evenly
    (at random) over its replicas, as the rank loads assume."""
    import random

    rng = random.Random(seed)
    slots_per_node = len(placement.physical_to_logical) // num_nodes
    nodes_of = [[slot // slots_per_node for slot in r] for r in placement.replicas()]
    return statistics.mean(len({rng.choice(nodes_of[e]) for e in experts})
                           for experts in trace)


def hierarchical_rows() -> list[dict]:
    rows = []
    traces = group_limited_traces(8192, 1.0, layers=4, seed=0)
    loads = [torch.bincount(torch.tensor(t).flatten(), minlength=256).tolist() for t in traces]
    for nodes, ranks, redundant in ((2, 16, 32), (4, 32, 32), (8, 64, 64)):
        row = dict(nodes=nodes, ranks=ranks, redundant=redundant)
        for policy in ("global", "hierarchical"):
            imbalance, spread = [], []
            for layer, (trace, load) in enumerate(zip(traces, loads)):
                start = initial_placement(256, ranks, redundant)
                placed = (rebalance(load, ranks, 256 + redundant, start) if policy == "global"
                          else rebalance_hierarchical(load, ranks, 256 + redundant, 8, nodes,
                                                      start))
                imbalance.append(placed.imbalance(load))
                spread.append(_nodes_per_token(trace, placed, nodes, layer))
            row[policy] = (statistics.mean(imbalance), statistics.mean(spread))
        start = initial_placement(256, ranks, redundant)
        row["before"] = statistics.mean(start.imbalance(load) for load in loads)
        rows.append(row)
        print(row, flush=True)
    return rows


def hierarchical_section(rows: list[dict]) -> str:
    lines = [
        "## EPLB across nodes: the hierarchical placement (benchmarks/bench_expert_parallel.py)",
        "",
        "Traces routed as DeepSeek-V3 routes (256 experts in 8 groups; each of 8192 tokens "
        "keeps its 4 best groups and takes its 8 experts from them; Zipf(1.0) popularity "
        "shuffled per layer; mean of 4 layers). The global policy packs every replica onto "
        "any rank; the hierarchical one (`place` picks it when the nodes divide the groups) "
        "first packs whole groups onto nodes, then places each node's experts on its own "
        "ranks. Nodes per token: the distinct machines a token's 8 experts are on (each "
        "expert's tokens spread evenly over its replicas), the dispatch traffic that leaves "
        "the node.",
        "",
        "| nodes | ranks | redundant slots | max/mean in checkpoint order | max/mean global "
        "| max/mean hierarchical | nodes per token, global | nodes per token, hierarchical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['nodes']} | {r['ranks']} | {r['redundant']} | {r['before']:.2f} "
                     f"| {r['global'][0]:.2f} | {r['hierarchical'][0]:.2f} "
                     f"| {r['global'][1]:.2f} | **{r['hierarchical'][1]:.2f}** |")
    lines += [
        "",
        "Keeping groups whole trades balance for traffic: with fewer groups per node a node's "
        "load is its few groups' load, which no placement on its ranks can even out (one "
        "group per node is the extreme). `eplb_config.policy` chooses: `auto` (hierarchical "
        "wherever the nodes divide the groups, as DeepSeek's and vLLM's EPLB do), `global` "
        "or `hierarchical`.",
    ]
    return "\n".join(lines)


def _moved(first, second) -> int:
    """Replicas a rank gains from ``first`` to ``second``: the experts to be sent."""
    return sum(len(set(second.rank_experts(r)) - set(first.rank_experts(r)))
               for r in range(first.num_ranks))


def build_moe_checkpoint(out: Path) -> Path:
    import transformers

    tokenizer = build_demo_tokenizer()
    config = transformers.Qwen3MoeConfig(
        vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=512, intermediate_size=1024,
        moe_intermediate_size=512, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=4096,
        initializer_range=0.05, tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 3000, (prompt_len,), generator=g).tolist() for _ in range(batch)]


def _decode(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / wall, tokens


def engine_rows(model: str, device: str, reps: int) -> tuple[list[dict], dict]:
    setups = {
        "TP=1": dict(tensor_parallel_size=1),
        "TP=2": dict(tensor_parallel_size=2),
        "TP=2 + EP": dict(tensor_parallel_size=2, enable_expert_parallel=True),
        "TP=2 + EP + EPLB": dict(tensor_parallel_size=2, enable_expert_parallel=True,
                                 enable_eplb=True, eplb_config=EPLB),
    }
    engines = {name: LLM(model, progress=False, device=device, enable_prefix_caching=False,
                         **options) for name, options in setups.items()}
    rows = []
    for name, llm in engines.items():
        executor = llm.engine.core.executor
        rows.append(dict(name=name, weights=executor.collective_rpc("weight_bytes")))
    batch, prompt_len, max_tokens = 16, 64, 48
    for llm in engines.values():  # warm-up
        _decode(llm, _prompts(batch, 16, 0), 2)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(reps):
        prompts = _prompts(batch, prompt_len, rep + 1)
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        outputs = {}
        for name in order:
            rate, outputs[name] = _decode(engines[name], prompts, max_tokens)
            rates[name].append(rate)
        assert all(out == outputs["TP=1"] for out in outputs.values()), "tokens differ"
    for row in rows:
        name = row["name"]
        llm = engines[name]
        ratios = [r / base for r, base in zip(rates[name], rates["TP=1"])]
        row.update(rate=statistics.median(rates[name]), ratio=statistics.median(ratios),
                   low=min(ratios), high=max(ratios))
        if name != "TP=1":  # decode-only collectives: 1-token prompts, then max_tokens steps
            before = llm.engine.core.executor.call("collective_stats")
            _decode(llm, _prompts(batch, 1, 99), max_tokens)
            after = llm.engine.core.executor.call("collective_stats")
            row["per_step"] = {k: ((after[k][0] - before[k][0]) / max_tokens,
                                   (after[k][1] - before[k][1]) / max_tokens) for k in after}
    eplb_ranks = engines["TP=2 + EP + EPLB"].engine.core.executor.collective_rpc(
        "expert_placements")
    eplb = {"rearrangements": eplb_ranks[0]["eplb"]["rearrangements"],
            "moved": sum(r["eplb"]["experts_moved"] for r in eplb_ranks),
            "bytes": sum(r["eplb"]["bytes_received"] for r in eplb_ranks),
            "seconds": max(r["eplb"]["seconds"] for r in eplb_ranks),
            "imbalance": eplb_ranks[0]["eplb"]["last_imbalance"]}
    for llm in engines.values():
        llm.engine.core.shutdown()
    return rows, eplb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--hierarchical-only", action="store_true",
                        help="only part 3 (pure Python, seconds)")
    args = parser.parse_args()
    hierarchical = hierarchical_section(hierarchical_rows())
    print(hierarchical)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_expert_parallel_hierarchical",
                      hierarchical)
    if args.hierarchical_only:
        return
    placements = placement_rows()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_moe_checkpoint(Path(tmp) / "moe"))
        rows, eplb = engine_rows(model, args.device, args.reps)
    whole = rows[0]["weights"][0]
    lines = [
        "## Expert parallelism and EPLB (benchmarks/bench_expert_parallel.py)",
        "",
        "**EPLB placement** on synthetic skewed traces (DeepSeek-V3's shape: 256 routed "
        "experts, 8 distinct per token, 8192 tokens, Zipf popularity shuffled per layer; mean "
        "of 8 layers). Max/mean rank load with the experts in checkpoint order, after "
        "`rebalance`, and the bound no placement beats (the heaviest replica alone). Then the "
        "next window, the same skew with ±5% noise per expert: the replicas moved and the "
        "max/mean after it, with plain greedy packing and with packing that prefers an "
        f"expert's current rank within {STICKINESS:.0%} of a mean rank load (the default):",
        "",
        "| Zipf exponent | ranks | redundant slots | before | after EPLB | bound "
        "| next window: moved, greedy | moved, sticky | max/mean greedy | max/mean sticky |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in placements:
        moved, shifted = r["moved"], r["shifted"]
        lines.append(f"| {r['exponent']} | {r['ranks']} | {r['redundant']} | {r['before']:.2f} "
                     f"| **{r['after']:.2f}** | {r['bound']:.2f} | {moved[0.0]:.0f} "
                     f"| **{moved[STICKINESS]:.0f}** | {shifted[0.0]:.2f} "
                     f"| {shifted[STICKINESS]:.2f} |")
    lines += [
        "",
        f"**Through the engine** on {args.device}: a random-weight Qwen3-MoE (hidden 512, 6 "
        f"layers, {EXPERTS} experts of 512, top {TOP_K}), 16 prompts × 64 → 48 greedy tokens, "
        f"{args.reps} repetitions in alternating order, tokens checked equal across all four. "
        "On a CPU the two ranks share its cores (one torch thread each); the TP=1 engine uses "
        "them all.",
        "",
        "| setup | weights per rank | decode tok/s | vs TP=1 | all-reduce per decode step |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        weights = ", ".join(f"{b / 2**20:.1f} MiB ({b / whole:.2f}x)" for b in r["weights"])
        per_step = r.get("per_step", {}).get("all_reduce")
        reduce = f"{per_step[0]:.0f} calls, {per_step[1] / 1024:.0f} KiB" if per_step else "—"
        lines.append(f"| {r['name']} | {weights} | {r['rate']:.1f} | **{r['ratio']:.2f}** "
                     f"({r['low']:.2f}–{r['high']:.2f}) | {reduce} |")
    lines += [
        "",
        f"EPLB in that run (window {EPLB['window_size']} steps, every "
        f"{EPLB['step_interval']} steps, {EPLB['num_redundant_experts']} redundant slots): "
        f"{eplb['rearrangements']} rearrangements moved {eplb['moved']} expert replicas "
        f"({eplb['bytes'] / 2**20:.1f} MiB) between the ranks in {1e3 * eplb['seconds']:.0f} ms "
        f"in all; the last took the worst layer's max/mean rank load from "
        f"{eplb['imbalance'][0]:.2f} to {eplb['imbalance'][1]:.2f}. Random weights route "
        "almost evenly, so on this model EPLB has little to gain; the placement table above "
        "is where the skew is.",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_expert_parallel", body)


if __name__ == "__main__":
    main()
