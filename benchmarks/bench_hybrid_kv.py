"""Hybrid KV layout figures (issue 15): what sliding-window layer groups save.

The real KV manager (openinfer.kv.kv_manager: one pool of pages shared by every layer group) on
the layer specs of published models, each beside the same model with every layer's KV kept in
full (what an engine without window groups holds):

1. KV bytes one 32k-token request holds at its end (a 2048-token chunked prefill of 30k tokens,
   then decodes), and at its peak.
2. How many concurrent 8k-token requests (8192 tokens of context each) one fixed
   --kv-cache-memory admits: requests are added until the manager refuses one.

No timing: block counts times bytes per block, so the figures do not depend on the machine.

    .venv/bin/python benchmarks/bench_hybrid_kv.py [--no-write]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from doc_sections import write_section

from openinfer.kv.kv_manager import KVCacheManager
from openinfer.kv.spec import (
    SKIPPED,
    FullAttentionSpec,
    SlidingWindowSpec,
    group_layers,
    page_bytes,
)

REPO = Path(__file__).resolve().parent.parent
BLOCK, CHUNK = 16, 2048
GiB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    window: int
    windowed: str  # "all" or "alternate" (even layers windowed)

    def specs(self, hybrid: bool) -> list:
        full = FullAttentionSpec(BLOCK, self.kv_heads, self.head_dim, "bfloat16")
        window = SlidingWindowSpec(BLOCK, self.kv_heads, self.head_dim, "bfloat16", self.window)
        return [window if hybrid and (self.windowed == "all" or i % 2 == 0) else full
                for i in range(self.layers)]


MODELS = [
    ModelShape("gpt-oss-20b", 24, 8, 64, 128, "alternate"),
    ModelShape("Gemma-2-9B", 42, 8, 256, 4096, "alternate"),
    ModelShape("Mistral-7B-v0.1", 32, 8, 128, 4096, "all"),
]


def held_bytes(kv: KVCacheManager, request_id: str) -> int:
    return sum(sum(b != SKIPPED for b in table) * group.bytes_per_block
               for table, group in zip(kv.block_table(request_id), kv.groups))


def one_long_request(model: ModelShape, hybrid: bool, length: int = 32768,
                     prompt: int = 30720) -> tuple[int, int]:
    """(bytes held at the end, peak bytes) of one request, prefilled in chunks then decoded."""
    groups = group_layers(model.specs(hybrid))
    kv = KVCacheManager(groups, 4 * len(groups) * length // BLOCK, enable_caching=False)
    computed, peak = 0, 0
    while computed < length:
        step = min(CHUNK, prompt - computed) if computed < prompt else 1
        assert kv.allocate_slots("r", computed + step, num_computed_tokens=computed) is not None
        computed += step
        peak = max(peak, held_bytes(kv, "r"))
    # The next step's allocation releases what the last token's window left behind.
    kv.allocate_slots("r", computed, num_computed_tokens=computed)
    return held_bytes(kv, "r"), peak


def concurrent_requests(model: ModelShape, hybrid: bool, memory: int, context: int = 8192) -> int:
    groups = group_layers(model.specs(hybrid))
    kv = KVCacheManager(groups, memory // page_bytes(groups), enable_caching=False)
    n = 0
    while n < 10_000:
        rid, computed = f"r{n}", 0
        while computed < context:  # chunked prefill, releasing behind the window as it goes
            step = min(CHUNK, context - computed)
            if kv.allocate_slots(rid, computed + step, num_computed_tokens=computed) is None:
                kv.free(rid)
                return n
            computed += step
        kv.allocate_slots(rid, computed, num_computed_tokens=computed)
        n += 1
    return n


def live_blocks(groups: list, length: int = 32768, prompt: int = 30720) -> list[int]:
    """Blocks one request holds in each group at the end of ``length`` tokens: ``prompt``
    prefilled in CHUNK-token chunks, then decoded one by one."""
    kv = KVCacheManager(groups, 4 * len(groups) * length // BLOCK, enable_caching=False)
    computed = 0
    while computed < length:
        step = min(CHUNK, prompt - computed) if computed < prompt else 1
        assert kv.allocate_slots("r", computed + step, num_computed_tokens=computed) is not None
        computed += step
    kv.allocate_slots("r", computed, num_computed_tokens=computed)
    return [sum(b != SKIPPED for b in table) for table in kv.block_table("r")]


def v4_figures(length: int = 32768, prompt: int = 30720) -> str:
    """DeepSeek-V4 at transformers' default config (43 layers, head_dim 512, window 128, CSA
    ratio 4 with a 128-dim indexer, HCA ratio 128): its KV slots as openinfer declares them."""
    import torch
    import transformers

    from openinfer.models.arch import ArchConfig
    from openinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

    hf = transformers.DeepseekV4Config().to_dict()
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(ArchConfig.from_hf(hf))
    groups = group_layers(model.kv_cache_specs(BLOCK, "bfloat16"))
    live = live_blocks(groups, length, prompt)
    ideal = sum(n * g.bytes_per_block for n, g in zip(live, groups))
    padded = sum(live) * page_bytes(groups)
    full = length * hf["num_hidden_layers"] * hf["head_dim"] * 2  # its one K = V vector, bf16
    return (f"| DeepSeek-V4 ({hf['num_hidden_layers']} layers, head_dim {hf['head_dim']}, "
            f"{len(groups)} layer groups) | {ideal / 2**20:.0f} MiB | {padded / 2**20:.0f} MiB | "
            f"{full / 2**20:.0f} MiB | {full / ideal:.1f}x |")


def figures() -> str:
    rows = ["| model (bf16, block 16) | window | 32k request held: hybrid | all layers full | saved | "
            "peak hybrid (2048-token chunks) | 8k requests in 16 GiB: hybrid | all full | ratio |",
            "|---|---|---|---|---|---|---|---|---|"]
    for model in MODELS:
        end_h, peak_h = one_long_request(model, hybrid=True)
        end_f, _ = one_long_request(model, hybrid=False)
        conc_h = concurrent_requests(model, True, 16 * GiB)
        conc_f = concurrent_requests(model, False, 16 * GiB)
        kind = f"{model.window} ({'every layer' if model.windowed == 'all' else 'every 2nd layer'})"
        rows.append(f"| {model.name} ({model.layers} layers, {model.kv_heads}x{model.head_dim}) | {kind} | "
                    f"{end_h / 2**20:.0f} MiB | {end_f / 2**20:.0f} MiB | {1 - end_h / end_f:.0%} | "
                    f"{peak_h / 2**20:.0f} MiB | {conc_h} | {conc_f} | {conc_h / conc_f:.2f}x |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    table = figures()
    v4 = v4_figures()
    print(v4)
    body = f"""## Hybrid KV layout: sliding-window groups (benchmarks/bench_hybrid_kv.py)

The real KV manager and pool sizing on the layer shapes of published models, each beside the
same model with every layer's KV kept in full. A window group holds only the blocks its next
queries read (entries behind the window are released during long prefills and decodes,
{CHUNK}-token chunks); all groups draw pages from one pool, so what the window layers do not
hold serves more requests. Block counts times bytes per block: no timing, no machine
dependence.

{table}

DeepSeek-V4: the bytes one 32k-token request holds (bf16, block 16) in its KV slots (window
keys, compressor and indexer raw rows over the last 128/256/8 tokens, compressed entries and
indexer keys), as the groups' own bytes and as pages of the shared pool, beside every layer
keeping its one 512-dim K = V vector for all 32k tokens:

| model | held: V4 slots | held: pool pages | all layers full | full / V4 |
|---|---|---|---|---|
{v4}

Layer groups are cut to about one page (the largest single layer's block, a CSA compressor's
raw rows), so most pages are full; what remains padded is the groups smaller than a page (the
indexer keys and HCA entries of all their layers) and HCA's entries, one per 8 token blocks
but one page per block. Per-group block sizes (vLLM's unified page) would remove that: not
built yet.

The 32k-token request's window layers hold O(window + chunk) tokens whatever its length; its
full layers hold all 32k. An 8k request still holds its whole context in the full layers and
about window + chunk tokens in the window layers, so the gain at 8k is largest for short
windows (gpt-oss) and for models windowed everywhere (Mistral).
"""
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_hybrid_kv", body)


if __name__ == "__main__":
    main()
