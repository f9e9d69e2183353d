"""A random-weight DSpark drafter checkpoint for a target checkpoint (the format of
openinfer/models/dspark.py), and an independent plain-torch reference of its drafting:
the target's hidden states from transformers, every other step written out here."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def build_dspark_drafter(path: Path, target: Path, *, num_layers: int = 1, block_size: int = 4,
                         target_layer_ids: tuple[int, ...] = (0, 1), markov_rank: int = 8,
                         noise_token_id: int = 4, seed: int = 7, num_heads: int = 4,
                         num_kv_heads: int = 2, head_dim: int = 16,
                         intermediate_size: int = 96) -> Path:
    target_config = json.loads((target / "config.json").read_text())
    hidden, vocab = target_config["hidden_size"], target_config["vocab_size"]
    config = {
        "architectures": ["DSparkDrafter"], "model_type": "dspark",
        "hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "intermediate_size": intermediate_size, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "qk_norm": True,
        "max_position_embeddings": target_config["max_position_embeddings"],
        "dspark_block_size": block_size, "dspark_target_layer_ids": list(target_layer_ids),
        "dspark_markov_rank": markov_rank, "dspark_noise_token_id": noise_token_id,
        "dspark_confidence_temperature": 2.0,
    }
    g = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return 0.05 * torch.randn(*shape, generator=g)

    def norm(width: int) -> torch.Tensor:  # not 1: a forgotten norm weight shows
        return 1 + 0.2 * torch.randn(width, generator=g)

    tensors = {"main_proj.weight": weight(hidden, len(target_layer_ids) * hidden),
               "main_norm.weight": norm(hidden), "norm.weight": norm(hidden),
               "markov_head.embed.weight": torch.randn(vocab, markov_rank, generator=g),
               "markov_head.head.weight": weight(vocab, markov_rank),
               "confidence_head.proj.weight": 0.5 * torch.randn(1, hidden + markov_rank,
                                                                generator=g)}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors |= {p + "input_layernorm.weight": norm(hidden),
                    p + "post_attention_layernorm.weight": norm(hidden),
                    p + "self_attn.q_proj.weight": weight(num_heads * head_dim, hidden),
                    p + "self_attn.k_proj.weight": weight(num_kv_heads * head_dim, hidden),
                    p + "self_attn.v_proj.weight": weight(num_kv_heads * head_dim, hidden),
                    p + "self_attn.o_proj.weight": weight(hidden, num_heads * head_dim),
                    p + "self_attn.q_norm.weight": norm(head_dim),
                    p + "self_attn.k_norm.weight": norm(head_dim),
                    p + "mlp.gate_proj.weight": weight(intermediate_size, hidden),
                    p + "mlp.up_proj.weight": weight(intermediate_size, hidden),
                    p + "mlp.down_proj.weight": weight(hidden, intermediate_size)}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


class DSparkReference:
    """DSpark's drafting written out in float64 from the checkpoints: the target's layer
    inputs from transformers (``output_hidden_states``: entry t is what enters layer t)."""

    def __init__(self, drafter: Path, hf_target) -> None:
        self.config = json.loads((drafter / "config.json").read_text())
        self.w = {k: v.double() for k, v in load_file(drafter / "model.safetensors").items()}
        self.target = hf_target
        self.embed = hf_target.model.embed_tokens.weight.detach().double()
        self.head = hf_target.lm_head.weight.detach().double()

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config["rms_norm_eps"]
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        inv = 1.0 / self.config["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = positions.double()[:, None] * inv[None, :]
        cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
        half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + half * sin

    def _kv(self, p: str, x: torch.Tensor, positions: torch.Tensor):
        c, w = self.config, self.w
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(len(x), c["num_key_value_heads"], -1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(len(x), c["num_key_value_heads"], -1)
        return self._rope(self._rms(k, w[p + "self_attn.k_norm.weight"]), positions), v

    def drafts(self, tokens: list[int], count: int) -> tuple[list[int], list[float]]:
        """Greedy drafts after ``tokens`` (the last one just sampled) and their confidences."""
        c, w = self.config, self.w
        context = tokens[:-1]
        with torch.no_grad():
            out = self.target(torch.tensor([context]), output_hidden_states=True)
        features = torch.cat([out.hidden_states[t][0].double()
                              for t in c["dspark_target_layer_ids"]], -1)
        main = self._rms(features @ w["main_proj.weight"].T, w["main_norm.weight"])
        p = len(context) - 1
        block = c["dspark_block_size"]
        ctx_pos = torch.arange(p + 1)
        blk_pos = torch.arange(p + 1, p + 1 + block)
        ids = [tokens[-1]] + [c["dspark_noise_token_id"]] * (block - 1)
        x = self.embed[ids]
        heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        for i in range(c["num_hidden_layers"]):
            pre = f"layers.{i}."
            k_ctx, v_ctx = self._kv(pre, main, ctx_pos)
            h = self._rms(x, w[pre + "input_layernorm.weight"])
            q = (h @ w[pre + "self_attn.q_proj.weight"].T).view(block, heads, -1)
            q = self._rope(self._rms(q, w[pre + "self_attn.q_norm.weight"]), blk_pos)
            k_blk, v_blk = self._kv(pre, h, blk_pos)
            keys = torch.cat([k_ctx, k_blk]).repeat_interleave(heads // kv_heads, dim=1)
            values = torch.cat([v_ctx, v_blk]).repeat_interleave(heads // kv_heads, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) / q.shape[-1] ** 0.5
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(block, -1)
            x = x + attn @ w[pre + "self_attn.o_proj.weight"].T
            h = self._rms(x, w[pre + "post_attention_layernorm.weight"])
            gate, up = h @ w[pre + "mlp.gate_proj.weight"].T, h @ w[pre + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[pre + "mlp.down_proj.weight"].T
        logits = self._rms(x, w["norm.weight"]) @ self.head.T
        drafts, confidences, previous = [], [], tokens[-1]
        for i in range(count):
            e = w["markov_head.embed.weight"][previous]
            step_logits = logits[i] + e @ w["markov_head.head.weight"].T
            score = torch.cat([x[i], e]) @ w["confidence_head.proj.weight"][0]
            confidences.append(float(torch.sigmoid(score / c["dspark_confidence_temperature"])))
            previous = int(step_logits.argmax())
            drafts.append(previous)
        return drafts, confidences
