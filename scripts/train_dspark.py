"""Train a DSpark drafter (openinfer/models/dspark.py) for the built-in SmolLM2-135M-Instruct.

    .venv/bin/python scripts/train_dspark.py data  --work DIR [--prompts N]
    .venv/bin/python scripts/train_dspark.py train --work DIR [--minutes M]
    .venv/bin/python scripts/train_dspark.py confidence --work DIR
    .venv/bin/python scripts/train_dspark.py export --work DIR \
        --out openinfer/drafters/smollm2-135m-instruct-dspark

``data``: the target answers chat prompts built from installed packages' text
(scripts/dspark_data.py; greedy, through openinfer), then transformers runs it over every
prompt + answer once and keeps the inputs of the layers ``TARGET_LAYERS`` (bfloat16).
``train``: the drafter learns, at random anchors inside the answers, to predict the next
``BLOCK`` tokens from the context's features and the block [token at the anchor, noise...]
(every anchor of a sequence in one pass: each block sees the context before its anchor and
itself), with a cross-entropy weighted toward the block's first rows, and its confidence
head whether each row's argmax is right (binary cross-entropy, on detached inputs).
The target's embeddings and LM head are frozen.
``confidence``: the confidence head refitted alone (logistic regression) on the trained
drafter's rows. 2 CPU cores, about an hour in all.
``export``: config.json and bfloat16 safetensors in openinfer's DSpark format.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark_data import chat_prompts  # noqa: E402

TARGET_LAYERS = (2, 15, 29)
BLOCK = 4
MARKOV_RANK = 32
NUM_LAYERS = 1
INTERMEDIATE = 1536
MAX_ANSWER_TOKENS = 256
HOLD_OUT = 64
"""Sequences kept out of training: the acceptance printed at the end is theirs."""


def _target_dir() -> Path:
    from openinfer.model_source import resolve_model

    return Path(resolve_model("smollm2").path).parent


def _hf_target(dtype: torch.dtype):
    import transformers

    from openinfer.model_source import SMOLLM2_FILE

    return transformers.AutoModelForCausalLM.from_pretrained(
        _target_dir(), gguf_file=SMOLLM2_FILE, dtype=dtype).eval()


def make_data(work: Path, num_prompts: int) -> None:
    from openinfer import LLM, SamplingParams

    work.mkdir(parents=True, exist_ok=True)
    llm = LLM("smollm2", progress=False, max_num_seqs=64, max_model_len=2048)
    tok = llm.get_tokenizer()
    prompts = []
    for text in chat_prompts()[:num_prompts]:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
        prompts.append(tok.encode(chat, add_special_tokens=False))
    start = time.time()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_ANSWER_TOKENS))
    sequences = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    answer_tokens = sum(len(a) for _, a in sequences)
    print(f"generated {answer_tokens} answer tokens for {len(prompts)} prompts in "
          f"{time.time() - start:.0f} s", flush=True)
    del llm
    target = _hf_target(torch.bfloat16)
    features = []
    start = time.time()
    with torch.no_grad():
        for prompt, answer in sequences:
            ids = torch.tensor([prompt + answer])
            hidden = target.model(ids, output_hidden_states=True).hidden_states
            features.append(torch.cat([hidden[t][0] for t in TARGET_LAYERS], -1).clone())
    print(f"features of {sum(len(f) for f in features)} tokens in {time.time() - start:.0f} s",
          flush=True)
    torch.save({"sequences": sequences, "features": features, "layers": TARGET_LAYERS},
               work / "data.pt")


NOISE_TOKEN = 16
"""``<empty_output>``: a special token that ordinary text never holds."""
POSITION_DECAY = 3.0
"""Row i's loss weight exp(-i / this): a later draft counts only if the earlier ones hold."""
ANCHORS = 48
"""Anchors per sequence per visit."""
SEQUENCES_PER_STEP = 4


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [T, heads, D] rotated at ``positions`` (rotate-half, as Llama)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv[None, :]
    cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos.to(x.dtype) + half * sin.to(x.dtype)


class DraftLayer(nn.Module):
    def __init__(self, target_layer: nn.Module) -> None:
        super().__init__()
        attn, mlp = target_layer.self_attn, target_layer.mlp
        # Initialised from the target's last layer (same shapes), a start that already
        # maps hidden states to hidden states.
        self.input_layernorm = nn.Parameter(target_layer.input_layernorm.weight.detach().float().clone())
        self.post_attention_layernorm = nn.Parameter(
            target_layer.post_attention_layernorm.weight.detach().float().clone())
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nn.Parameter(getattr(attn, name).weight.detach().float().clone()))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, name, nn.Parameter(getattr(mlp, name).weight.detach().float().clone()))


class Trainee(nn.Module):
    """The drafter as a differentiable module over a whole sequence and many anchors."""

    def __init__(self, target, eps: float, theta: float) -> None:
        super().__init__()
        c = target.config
        self.hidden, self.heads, self.kv_heads = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
        self.head_dim = self.hidden // self.heads
        self.eps, self.theta = eps, theta
        n = len(TARGET_LAYERS)
        main = torch.zeros(self.hidden, n * self.hidden)
        main[:, -self.hidden:] = torch.eye(self.hidden)  # start from the last feature alone
        self.main_proj = nn.Parameter(main)
        self.main_norm = nn.Parameter(torch.ones(self.hidden))
        self.layers = nn.ModuleList(DraftLayer(target.model.layers[-1]) for _ in range(NUM_LAYERS))
        self.norm = nn.Parameter(target.model.norm.weight.detach().float().clone())
        self.markov_embed = nn.Parameter(0.02 * torch.randn(c.vocab_size, MARKOV_RANK))
        self.markov_head = nn.Parameter(torch.zeros(c.vocab_size, MARKOV_RANK))
        self.confidence = nn.Parameter(torch.zeros(1, self.hidden + MARKOV_RANK))
        embed = target.model.embed_tokens.weight.detach()
        self.register_buffer("embed", embed.to(torch.bfloat16), persistent=False)
        self.register_buffer("head", target.lm_head.weight.detach().to(torch.bfloat16),
                             persistent=False)
        self.capture: list[torch.Tensor] | None = None
        """Where set, each forward appends its confidence head's inputs (``fit_confidence``)."""

    def _heads(self, layer: DraftLayer, x: torch.Tensor, positions: torch.Tensor):
        q = (x @ layer.q_proj.T).view(len(x), self.heads, self.head_dim)
        k = (x @ layer.k_proj.T).view(len(x), self.kv_heads, self.head_dim)
        v = (x @ layer.v_proj.T).view(len(x), self.kv_heads, self.head_dim)
        return _rope(q, positions, self.theta), _rope(k, positions, self.theta), v

    def forward(self, features: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor):
        """Logits [A, B, V], confidence logits [A, B] and the targets [A, B] of the blocks
        at ``anchors`` (positions of the block's first token; its context: those before)."""
        T, A = len(ids), len(anchors)
        offsets = torch.arange(BLOCK)
        rows = (anchors[:, None] + offsets[None, :]).flatten()  # block positions
        targets = ids[(anchors[:, None] + 1 + offsets[None, :])]
        previous = ids[rows].view(A, BLOCK)  # row i's previous token: the true one
        main = _rms(features.float() @ self.main_proj.T, self.main_norm, self.eps)
        block_ids = torch.full((A, BLOCK), NOISE_TOKEN)
        block_ids[:, 0] = ids[anchors]
        x = self.embed[block_ids.flatten()].float()
        ctx_positions = torch.arange(T)
        allowed_ctx = ctx_positions[None, :] < anchors.repeat_interleave(BLOCK)[:, None]
        same = torch.arange(A).repeat_interleave(BLOCK)
        allowed_blk = same[:, None] == same[None, :]
        mask = torch.cat([allowed_ctx, allowed_blk], 1)
        for layer in self.layers:
            _, k_ctx, v_ctx = self._heads(layer, main, ctx_positions)
            h = _rms(x, layer.input_layernorm, self.eps)
            q, k_blk, v_blk = self._heads(layer, h, rows)
            keys = torch.cat([k_ctx, k_blk]).transpose(0, 1)
            values = torch.cat([v_ctx, v_blk]).transpose(0, 1)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                                 enable_gqa=True)
            x = x + out.transpose(0, 1).reshape(len(rows), -1) @ layer.o_proj.T
            h = _rms(x, layer.post_attention_layernorm, self.eps)
            x = x + (F.silu(h @ layer.gate_proj.T) * (h @ layer.up_proj.T)) @ layer.down_proj.T
        logits = _rms(x, self.norm, self.eps).to(torch.bfloat16) @ self.head.T
        markov = self.markov_embed[previous.flatten()]
        logits = logits.float() + markov @ self.markov_head.T
        confidence_inputs = torch.cat([x.detach(), markov.detach()], -1)
        if self.capture is not None:
            self.capture.append(confidence_inputs.float())
        confidence = confidence_inputs @ self.confidence.T
        return logits.view(A, BLOCK, -1), confidence.view(A, BLOCK), targets


def _anchors(prompt_len: int, length: int, count: int, rng: random.Random) -> torch.Tensor:
    """Anchor positions inside the answer (the prompt's last token drafts the answer's first)."""
    first, last = prompt_len - 1, length - BLOCK - 1
    if last < first:
        return torch.empty(0, dtype=torch.long)
    choices = list(range(first, last + 1))
    return torch.tensor(sorted(rng.sample(choices, min(count, len(choices)))))


def _accepted(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per anchor, how many leading greedy drafts are right."""
    right = (logits.argmax(-1) == targets).int()
    return right.cumprod(1).sum(1)


def train(work: Path, minutes: float) -> None:
    torch.set_num_threads(2)
    data = torch.load(work / "data.pt")
    sequences, features = data["sequences"], data["features"]
    target = _hf_target(torch.float32)
    eps = target.config.rms_norm_eps
    theta = float(getattr(target.config, "rope_theta", None)
                  or target.config.rope_parameters["rope_theta"])
    model = Trainee(target, eps, theta)
    del target
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95))
    order = list(range(len(sequences) - HOLD_OUT))
    held = list(range(len(sequences) - HOLD_OUT, len(sequences)))
    rng = random.Random(0)
    start, deadline, step = time.time(), time.time() + 60 * minutes, 0
    weights = torch.exp(-torch.arange(BLOCK) / POSITION_DECAY)

    def evaluate() -> str:
        accepted, anchors, conf_right, conf_all = 0, 0, 0.0, 0
        with torch.no_grad():
            for i in held:
                prompt, answer = sequences[i]
                ids = torch.tensor(prompt + answer)
                a = _anchors(len(prompt), len(ids), 32, random.Random(i))
                if not len(a):
                    continue
                logits, conf, targets = model(features[i], ids, a)
                accepted += int(_accepted(logits, targets).sum())
                anchors += len(a)
                right = (logits.argmax(-1) == targets).float()
                conf_right += float(((torch.sigmoid(conf) > 0.5).float() == right).float().sum())
                conf_all += right.numel()
        return (f"held-out: {1 + accepted / max(anchors, 1):.3f} tokens per verification (k={BLOCK}), "
                f"confidence right {conf_right / max(conf_all, 1):.3f}")

    print("before training:", evaluate(), flush=True)
    while time.time() < deadline:
        rng.shuffle(order)
        for first in range(0, len(order), SEQUENCES_PER_STEP):
            progress = (time.time() - start) / (deadline - start)
            if progress >= 1:
                break
            lr = 1e-3 * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
            for group in optim.param_groups:
                group["lr"] = lr
            optim.zero_grad()
            total = 0.0
            for i in order[first:first + SEQUENCES_PER_STEP]:
                prompt, answer = sequences[i]
                ids = torch.tensor(prompt + answer)
                anchors = _anchors(len(prompt), len(ids), ANCHORS, rng)
                if not len(anchors):
                    continue
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits, conf, targets = model(features[i], ids, anchors)
                ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                     reduction="none").view(len(anchors), BLOCK)
                right = (logits.detach().argmax(-1) == targets).float()
                bce = F.binary_cross_entropy_with_logits(conf.float(), right)
                loss = (ce * weights).sum(1).mean() / weights.sum() + 0.1 * bce
                (loss / SEQUENCES_PER_STEP).backward()
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            step += 1
            if step % 50 == 0:
                print(f"step {step} ({time.time() - start:.0f} s): loss {total / SEQUENCES_PER_STEP:.3f}, "
                      f"lr {lr:.2e}", flush=True)
            if step % 400 == 0:
                print(evaluate(), flush=True)
                torch.save(model.state_dict(), work / "drafter.pt")
    print(f"after {step} steps:", evaluate(), flush=True)
    torch.save(model.state_dict(), work / "drafter.pt")


def fit_confidence(work: Path, num_sequences: int = 300) -> None:
    """Refit the confidence head alone, by logistic regression over the trained drafter's
    rows (its inputs are the unnormed final state: a step size that suits the drafter swings
    this head's logits; a convex fit does not care)."""
    torch.set_num_threads(2)
    data = torch.load(work / "data.pt")
    sequences, features = data["sequences"], data["features"]
    target = _hf_target(torch.float32)
    model = Trainee(target, target.config.rms_norm_eps,
                    float(getattr(target.config, "rope_theta", None)
                          or target.config.rope_parameters["rope_theta"]))
    del target
    model.load_state_dict(torch.load(work / "drafter.pt"))
    inputs, labels = [], []
    rng = random.Random(1)
    with torch.no_grad():
        for i in rng.sample(range(len(sequences) - HOLD_OUT), num_sequences):
            prompt, answer = sequences[i]
            ids = torch.tensor(prompt + answer)
            anchors = _anchors(len(prompt), len(ids), 32, rng)
            if not len(anchors):
                continue
            model.capture = []
            logits, _, targets = model(features[i], ids, anchors)
            inputs.append(model.capture.pop())
            labels.append((logits.argmax(-1) == targets).float().flatten())
    x, y = torch.cat(inputs).double(), torch.cat(labels).double()
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    optim = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        optim.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w, y) + 1e-4 * w.pow(2).sum()
        loss.backward()
        return loss

    optim.step(closure)
    predicted = torch.sigmoid(x @ w)
    print(f"confidence fitted on {len(y)} rows (accepted {float(y.mean()):.3f}): "
          f"right {float(((predicted > 0.5).double() == y).double().mean()):.3f}, "
          f"mean confidence {float(predicted.mean()):.3f}", flush=True)
    with torch.no_grad():
        model.confidence.copy_(w.float()[None, :])
    torch.save(model.state_dict(), work / "drafter.pt")


def export(work: Path, out: Path) -> None:
    """The trained drafter in openinfer's DSpark format (bfloat16 weights)."""
    from safetensors.torch import save_file

    target = _hf_target(torch.float32)
    c = target.config
    state = torch.load(work / "drafter.pt")
    tensors = {"main_proj.weight": state["main_proj"], "main_norm.weight": state["main_norm"],
               "norm.weight": state["norm"], "markov_head.embed.weight": state["markov_embed"],
               "markov_head.head.weight": state["markov_head"],
               "confidence_head.proj.weight": state["confidence"]}
    for i in range(NUM_LAYERS):
        p = f"layers.{i}."
        tensors[p + "input_layernorm.weight"] = state[p + "input_layernorm"]
        tensors[p + "post_attention_layernorm.weight"] = state[p + "post_attention_layernorm"]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{p}self_attn.{name}.weight"] = state[p + name]
        for name in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"{p}mlp.{name}.weight"] = state[p + name]
    config = {
        "architectures": ["DSparkDrafter"], "model_type": "dspark",
        "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
        "num_hidden_layers": NUM_LAYERS, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.hidden_size // c.num_attention_heads,
        "intermediate_size": INTERMEDIATE, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]),
        "max_position_embeddings": c.max_position_embeddings, "qk_norm": False,
        "dspark_block_size": BLOCK, "dspark_target_layer_ids": list(TARGET_LAYERS),
        "dspark_markov_rank": MARKOV_RANK, "dspark_noise_token_id": NOISE_TOKEN,
        "dspark_confidence_temperature": 1.0,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out} ({size / 2**20:.1f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=["data", "train", "confidence", "export"])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=1600)
    parser.add_argument("--minutes", type=float, default=40.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.phase == "data":
        make_data(args.work, args.prompts)
    elif args.phase == "train":
        train(args.work, args.minutes)
    elif args.phase == "confidence":
        fit_confidence(args.work)
    else:
        export(args.work, args.out)


if __name__ == "__main__":
    main()
