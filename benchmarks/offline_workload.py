"""What bench_offline.py benchmarks: the workload (prompt counts and lengths, GEMM shapes to time)
and the facts of the model under test, read from its config and safetensors headers."""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass
from pathlib import Path

GiB = 1024**3


@dataclass(frozen=True)
class Workload:
    preset: str
    """Demo preset built when --model is not given."""
    num_prompts: int
    prompt_len: int
    output_len: int
    latency_prompt_len: int
    latency_output_len: int
    matmul_shapes: tuple[tuple[int, int, int], ...]
    """(M, K, N): [M x K] @ [K x N]."""
    prefill_gemm: tuple[int, int, int]
    """The one of matmul_shapes that stands for a prefill step's GEMMs."""
    decode_gemm: tuple[int, int, int]
    """The one that stands for a decode step's GEMMs (M = the batch of decoding sequences)."""
    matmul_seconds: float
    copy_bytes: int
    seed: int = 0


FULL = Workload(
    preset="bench-0.3b", num_prompts=32, prompt_len=256, output_len=128,
    latency_prompt_len=512, latency_output_len=128,
    matmul_shapes=((2048, 2048, 2048), (2048, 1024, 3072), (256, 1024, 3072), (32, 1024, 3072)),
    prefill_gemm=(2048, 1024, 3072), decode_gemm=(32, 1024, 3072),
    matmul_seconds=2.0, copy_bytes=GiB,
)
QUICK = Workload(
    preset="tiny", num_prompts=4, prompt_len=32, output_len=16,
    latency_prompt_len=32, latency_output_len=16,
    matmul_shapes=((1024, 1024, 1024), (32, 1024, 3072)),
    prefill_gemm=(1024, 1024, 1024), decode_gemm=(32, 1024, 3072),
    matmul_seconds=0.3, copy_bytes=GiB // 8,
)


# --------------------------------------------------------------------------- prompts


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids, skipping the first three ids (the demo tokenizer's special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


def prompt_vocab_size(model_dir: Path) -> int:
    """Ids the tokenizer knows (prompts stay inside them); the model's vocab if unknown."""
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        data = json.loads(tokenizer_file.read_text())
        vocab = data.get("model", {}).get("vocab")
        if isinstance(vocab, dict) and vocab:
            return len(vocab)
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


# --------------------------------------------------------------------------- model facts


@dataclass(frozen=True)
class ModelFacts:
    path: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tied_embeddings: bool
    total_params: int
    embedding_params: int
    matmul_params: int
    """Weights of every Linear incl. the LM head (the tied embedding counts here if tied)."""
    decode_read_params: int
    """Parameters a decode step reads in full: all but the embedding table."""

    @property
    def weight_bytes(self) -> int:
        return 4 * self.total_params

    @property
    def decode_read_bytes(self) -> int:
        return 4 * self.decode_read_params


def safetensors_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, read from the safetensors headers (no tensor data is loaded)."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def model_facts(model_dir: Path) -> ModelFacts:
    hf = json.loads((model_dir / "config.json").read_text())
    shapes = safetensors_shapes(model_dir)
    numel = {name: _prod(shape) for name, shape in shapes.items()}
    embed = sum(n for name, n in numel.items() if name.endswith("embed_tokens.weight"))
    has_head = any(name.endswith("lm_head.weight") for name in numel)
    tied = bool(hf.get("tie_word_embeddings", False)) or not has_head
    head_from_embed = embed if tied and not has_head else 0
    matrices = sum(n for name, n in numel.items()
                   if len(shapes[name]) == 2 and not name.endswith("embed_tokens.weight"))
    total = sum(numel.values())
    return ModelFacts(
        path=str(model_dir), architecture=(hf.get("architectures") or ["?"])[0],
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        vocab_size=hf["vocab_size"], tied_embeddings=tied, total_params=total,
        embedding_params=embed, matmul_params=matrices + head_from_embed,
        decode_read_params=total - embed + head_from_embed,
    )


def _prod(shape: list[int]) -> int:
    result = 1
    for dim in shape:
        result *= dim
    return result
