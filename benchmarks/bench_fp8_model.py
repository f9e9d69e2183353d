"""A checkpoint in block-scaled FP8 served with its linear weights kept in fp8, beside the same
FP8 checkpoint multiplied out at load (OPENINFER_FP8_WEIGHTS=dequantize) and the bf16 original.

The FP8 checkpoint is made here from a bf16 one (the peers' qwen3-0.4b-random by default):
every linear layer's weight quantized per 128x128 tile to e4m3 with a ``weight_scale_inv``, as
DeepSeek-V3 and Qwen3-FP8 ship (embeddings, norms and the LM head stay bf16; a MoE model's
experts are quantized per expert, and kept in fp8 by the fused MoE kernel). Each variant runs
in its own process, rounds interleaved: batch-1 decode tokens/s (129 generated tokens less 1,
after a 16-token prompt), the resident bytes of the model's weights as held (experts packed
for the kernel included), and how many greedy tokens agree with the dequantized weights run
in float32 (a random model's logits hold near ties: any change of rounding, bf16 activations
included, parts the text sooner or later).

    .venv/bin/python benchmarks/bench_fp8_model.py [--model DIR] [--rounds 3] [--output PAGE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache/openinfer-peers/models/qwen3-0.4b-random"
BLOCK = 128
DECODE_TOKENS = 128

_RUN = r"""
import json, sys, time
import torch
from openinfer import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype=sys.argv[3], progress=False, max_model_len=512)
weight_bytes = llm.engine.core.executor.worker.weight_bytes()  # (packed experts as held)
prompt = {"prompt_token_ids": list(range(100, 116))}
def run(n):
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - start, out[0].outputs[0].token_ids
run(8)  # warm-up
one, _ = run(1)
many, tokens = run(1 + int(sys.argv[2]))
print(json.dumps({"tok_s": int(sys.argv[2]) / (many - one), "weight_bytes": weight_bytes,
                  "tokens": tokens}))
"""


def quantize(src: Path, dst: Path) -> None:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    for file in sorted(src.glob("*.safetensors")):
        out = {}
        for name, t in load_file(file).items():
            if t.dim() == 2 and name.endswith("proj.weight"):
                n, k = t.shape
                nb, kb = -(-n // BLOCK), -(-k // BLOCK)
                tiles = F.pad(t.float().abs(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
                scale = tiles.reshape(nb, BLOCK, kb, BLOCK).amax((1, 3)).clamp(min=1e-12) / 448
                full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
                out[name] = (t.float() / full).to(torch.float8_e4m3fn)
                out[name + "_scale_inv"] = scale
            else:
                out[name] = t
        save_file(out, dst / file.name, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def run_variant(path: Path, fp8_weights: str, dtype: str) -> dict:
    env = dict(os.environ, OPENINFER_FP8_WEIGHTS=fp8_weights)
    out = subprocess.run([sys.executable, "-c", _RUN, str(path), str(DECODE_TOKENS), dtype], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", help="write the table as this page's bench_fp8_model section")
    args = parser.parse_args()
    from openinfer.cpu_features import cpu_capability, cpu_model_name

    with tempfile.TemporaryDirectory() as tmp:
        fp8_path = Path(tmp) / "fp8"
        quantize(args.model, fp8_path)
        variants = {"fp8 kept": (fp8_path, "keep", "bfloat16"),
                    "fp8 dequantized to bf16": (fp8_path, "dequantize", "bfloat16"),
                    "bf16 original": (args.model, "keep", "bfloat16"),
                    "fp8 dequantized, fp32 compute": (fp8_path, "dequantize", "float32")}
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for r in range(args.rounds):
            names = list(variants)[r % len(variants):] + list(variants)[:r % len(variants)]
            for name in names:
                runs[name].append(run_variant(*variants[name]))
    reference = runs["fp8 dequantized, fp32 compute"][0]["tokens"]
    body = [f"`benchmarks/bench_fp8_model.py --rounds {args.rounds}`: `{args.model.name}` quantized "
            f"to block-scaled FP8 ({BLOCK}x{BLOCK} tiles, linear layers), batch-1 decode of "
            f"{DECODE_TOKENS} tokens, each variant in its own process, rounds interleaved. "
            f"CPU: {cpu_model_name()}, {cpu_capability()}.", "",
            "| variant | decode tok/s (median, range) | weight bytes as held | greedy tokens before the "
            "first that differs from fp32's on the dequantized weights |", "|---|---|---|---|"]
    for name, results in runs.items():
        rates = [x["tok_s"] for x in results]
        tokens = results[0]["tokens"]
        same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(reference))
        body.append(f"| {name} | {statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f}) | "
                    f"{results[0]['weight_bytes'] / 2**20:.0f} MiB | {same} of {len(reference)} |")
    print("\n".join(body))
    if args.output:
        from doc_sections import write_section

        suffix = "" if args.model == DEFAULT_MODEL else "_" + args.model.name.replace("-", "_")
        write_section(args.output, "bench_fp8_model" + suffix, "\n".join(body))

if __name__ == "__main__":
    main()
