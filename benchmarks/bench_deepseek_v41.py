"""DeepSeek-V4.1 end to end (issue 50): a small random V4.1 (window, C2 and C1 layers, the
YOCO split with shared KV, Engram, candidate blocks) beside openinfer's DeepSeek-V4 path and
transformers' V4 at the same sizes (transformers has no V4.1), offline greedy generation,
same prompts, same process; and the KV bytes a 32k-token request holds in each.

    .venv/bin/python benchmarks/bench_deepseek_v41.py [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_deepseek_v4 import CONFIG as V4_CONFIG
from bench_deepseek_v4 import transformers_generate
from bench_hybrid_kv import BLOCK, live_blocks
from doc_sections import write_section

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from v41_checkpoint import build_v41_checkpoint  # noqa: E402

V41 = dict(  # V4's benchmark sizes: hidden 256, 8 heads of 64, window 32, 8 experts top-2
    num_hidden_layers=4, num_nextn_predict_layers=0, compress_ratios=[0, 2, 1, 1],
    kv_source_layer_ids=[1, 2], index_k_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2],
    candidate_source_layer_id=None, engram_layer_ids=[0], engram_vocab_size=1009,
    hidden_size=256, num_attention_heads=8, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64,
    o_lora_rank=32, o_groups=2, vocab_size=4096, max_position_embeddings=32768, sliding_window=32,
    index_topk=1024, index_n_heads=4, index_head_dim=32, moe_intermediate_size=128,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, swiglu_limit=10.0)


def _generate(path: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    from openinfer import LLM, SamplingParams

    llm = LLM(path, progress=False, enable_prefix_caching=False, dtype="float32", max_model_len=4096,
              skip_tokenizer_init=True)
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([p[:16] for p in prompts[:2]], sp)  # warm-up
    start = time.perf_counter()
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    seconds = time.perf_counter() - start
    llm.engine.core.shutdown()
    return seconds, out


def kv_bytes(path: str) -> int:
    """Bytes one request of 32k tokens holds at its end in the model's KV slots (bf16,
    block 16; bench_hybrid_kv's request): the groups' own bytes."""
    from openinfer.config import ModelConfig
    from openinfer.kv.spec import group_layers
    from openinfer.models.arch import ArchConfig
    from openinfer.models.registry import get_model_class

    config = ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(
            ArchConfig.from_hf(config.hf_config, source_dir=config.path))
    groups = group_layers(model.kv_cache_specs(BLOCK, "bfloat16"))
    return sum(n * g.bytes_per_block for n, g in zip(live_blocks(groups), groups, strict=True))


def figures(batch: int = 8, prompt_len: int = 128, new_tokens: int = 32) -> str:
    import transformers

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, 4096, (batch, prompt_len), generator=g).tolist()
    total = batch * new_tokens
    rows = ["| model, engine | wall s | output tokens/s | KV held by one 32k-token request (bf16) |",
            "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        config = transformers.DeepseekV4Config(**V4_CONFIG)
        config.architectures = ["DeepseekV4ForCausalLM"]
        hf = transformers.DeepseekV4ForCausalLM(config).eval()
        hf.save_pretrained(f"{tmp}/v4")
        plain = build_v41_checkpoint(Path(tmp) / "v41", release=False, **V41)
        release = build_v41_checkpoint(Path(tmp) / "v41r", **V41)
        runs = {"DeepSeek-V4.1, openinfer (float32 weights)": str(plain),
                "DeepSeek-V4.1, openinfer (release format: fp8 projections and MXFP4 experts "
                "kept as loaded)": str(release),
                "DeepSeek-V4, openinfer": f"{tmp}/v4"}
        seconds = {}
        for name, path in runs.items():
            seconds[name], _ = _generate(path, prompts, new_tokens)
            rows.append(f"| {name} | {seconds[name]:.2f} | {total / seconds[name]:.1f} | "
                        f"{kv_bytes(path) / 2**20:.1f} MiB |")
            print(rows[-1], flush=True)
        theirs, _ = transformers_generate(hf, torch.tensor(prompts), new_tokens)
    rows.append(f"| DeepSeek-V4, transformers (cached generate, one at a time) | {theirs:.2f} | "
                f"{total / theirs:.1f} | - |")
    v41, v4 = seconds[next(iter(runs))], seconds["DeepSeek-V4, openinfer"]
    rows.append(f"| V4.1 (float32) / V4, openinfer | | {v4 / v41:.2f}x | |")
    rows.append(f"| V4.1 (float32, openinfer) / V4 (transformers) | | {theirs / v41:.2f}x | |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    table = figures()
    body = f"""## DeepSeek-V4.1 end to end (benchmarks/bench_deepseek_v41.py)

A random DeepSeek-V4.1 at the sizes of the DeepSeek-V4 benchmark above (hidden 256, 8 heads
of 64, window 32, 8 experts top-2, 4 layers: window with Engram, C2 with its indexer, two C1
consumers sharing one KV source's entries) beside that V4 (sliding, CSA, HCA, CSA), 8 prompts
of 128 tokens, 32 greedy tokens each, float32 compute. Both attend in torch, over padded
batches of the step's sequences (no fused kernel). transformers has no V4.1: its V4 generates
one sequence at a time. KV: the bytes one request of 32k tokens (30k prefilled in 2048-token
chunks, then decoded) holds in each model's slots: V4.1's consumers keep one entry per token
(C1) of their shared source, where V4's compressed layers keep one per 4 or 16.

{table}
"""
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_deepseek_v41", body)


if __name__ == "__main__":
    main()
