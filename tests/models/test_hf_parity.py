"""Model code matches Hugging Face transformers on random-weight checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from attention_support import ATTENTION_BACKENDS, attention_backend

import openinfer.config
from openinfer import LLM, SamplingParams
from openinfer.config import ModelConfig
from openinfer.kv.spec import group_layers
from openinfer.models.loader import load_model
from openinfer.worker.kv_cache import allocate_group_cache, per_layer_views

ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
BLOCK = 4  # small blocks so prompts span many of them


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


class PagedModel:
    """Runs our model on hand-made steps over a paged cache (block ids handed out in order)."""

    def __init__(self, path, num_blocks: int = 256, max_model_len: int | None = None,
                 attention: str = "auto", dtype: str = "auto") -> None:
        self.attention = attention_backend(attention)
        self.config = ModelConfig.from_pretrained(path, max_model_len=max_model_len, dtype=dtype)
        self.model = load_model(self.config, progress=False)
        specs = self.model.kv_cache_specs(BLOCK, str(self.config.dtype).removeprefix("torch."))
        # Every layer group gets its own cache; all share the block tables (nothing released).
        groups = group_layers(specs)
        self.caches = per_layer_views(groups, [allocate_group_cache(g, num_blocks, "cpu")
                                               for g in groups], len(specs))
        self.tables: dict[int, list[int]] = {}
        self.next_block = 0

    def step(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """chunks: (sequence id, token ids, start position); decodes (1 token) must come first."""
        for sid, tokens, start in chunks:
            table = self.tables.setdefault(sid, [])
            while len(table) * BLOCK < start + len(tokens):
                # Interleave sequences' blocks so block tables are not contiguous ranges.
                table.append(self.next_block)
                self.next_block += 1
        meta = self.attention.build_metadata(
            [len(t) for _, t, _ in chunks], [s + len(t) for _, t, s in chunks],
            [self.tables[sid] for sid, _, _ in chunks], BLOCK, "cpu")
        ids = torch.tensor([x for _, t, _ in chunks for x in t])
        pos = torch.tensor([p for _, t, s in chunks for p in range(s, s + len(t))])
        with torch.inference_mode():
            metas = [meta] * len(self.caches)
            return self.model.compute_logits(self.model(ids, pos, self.caches, metas))


def _hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("attention", ATTENTION_BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tied", [False, True])
def test_prompt_logits_match_transformers(arch, tied, attention, make_checkpoint, hf_model_loader):
    path = make_checkpoint(arch, tie_word_embeddings=tied)
    ours, hf = PagedModel(path, attention=attention), hf_model_loader(path)
    prompts = _prompts(ours.config.vocab_size, [7, 19, 2, 33])
    logits = ours.step([(i, p, 0) for i, p in enumerate(prompts)])
    offset = 0
    for p in prompts:
        torch.testing.assert_close(logits[offset:offset + len(p)], _hf_logits(hf, p),
                                   atol=2e-5, rtol=1e-4)
        offset += len(p)


@pytest.mark.parametrize("attention", ATTENTION_BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_logits_match(arch, attention, make_checkpoint,
                                                 hf_model_loader):
    """A prompt fed as chunks and single-token decodes, mixed in one batch, gives HF's logits."""
    path = make_checkpoint(arch)
    ours, hf = PagedModel(path, attention=attention), hf_model_loader(path)
    a, b, c = _prompts(ours.config.vocab_size, [21, 13, 9])
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}

    def run(chunks):
        out = ours.step(chunks)
        offset = 0
        for sid, tokens, _ in chunks:
            got[sid].append(out[offset:offset + len(tokens)])
            offset += len(tokens)

    run([(0, a[:5], 0), (1, b[:10], 0)])                    # two first chunks
    run([(1, b[10:11], 10), (0, a[5:14], 5), (2, c, 0)])    # decode-like step + continuation
    run([(1, b[11:12], 11), (0, a[14:], 14)])
    run([(1, b[12:13], 12)])
    for sid, prompt in enumerate((a, b, c)):
        torch.testing.assert_close(torch.cat(got[sid]), _hf_logits(hf, prompt),
                                   atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch,tied", [("LlamaForCausalLM", False), ("Qwen2ForCausalLM", True),
                                       ("Qwen3ForCausalLM", True), ("Qwen3ForCausalLM", False)])
def test_greedy_generation_matches_transformers(arch, tied, make_checkpoint, hf_model_loader):
    path = make_checkpoint(arch, tie_word_embeddings=tied)
    llm = LLM(str(path), block_size=BLOCK, progress=False)
    hf = hf_model_loader(path)
    prompts = _prompts(llm.engine.inputs.vocab_size, [3, 17, 40, 8, 25], seed=7)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
    llm.engine.check_integrity()


@pytest.mark.parametrize("arch,scaling", [
    ("LlamaForCausalLM", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ("Qwen2ForCausalLM", {"rope_type": "linear", "factor": 2.0}),
    ("Qwen3ForCausalLM", {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 128}),
])
def test_rope_scaling_matches_transformers(arch, scaling, make_checkpoint, hf_model_loader):
    path = make_checkpoint(arch, rope_scaling=scaling)
    ours, hf = PagedModel(path), hf_model_loader(path)
    (prompt,) = _prompts(ours.config.vocab_size, [150])
    torch.testing.assert_close(ours.step([(0, prompt, 0)]), _hf_logits(hf, prompt),
                               atol=5e-5, rtol=1e-4)


def test_rope_scaling_ignores_a_shorter_max_model_len(make_checkpoint, hf_model_loader):
    """Scaling reads the trained context (max_position_embeddings), not the serving limit."""
    path = make_checkpoint("Qwen3ForCausalLM")
    config = json.loads((path / "config.json").read_text())
    # As older configs say it: no original_max_position_embeddings (transformers 5 adds one).
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (path / "config.json").write_text(json.dumps(config))
    ours, hf = PagedModel(path, max_model_len=160), hf_model_loader(path)
    (prompt,) = _prompts(ours.config.vocab_size, [150])
    torch.testing.assert_close(ours.step([(0, prompt, 0)]), _hf_logits(hf, prompt),
                               atol=5e-5, rtol=1e-4)


def test_bfloat16_sharded_checkpoint_loads_as_float32(make_checkpoint, hf_model_loader,
                                                      monkeypatch):
    # dtype auto keeps bf16 checkpoints in bf16 on CPUs with AVX512_BF16/AMX: pose as one without.
    monkeypatch.setattr(openinfer.config, "cpu_flags", lambda: frozenset({"avx2"}))
    path = make_checkpoint("Qwen3ForCausalLM", dtype=torch.bfloat16, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    ours, hf = PagedModel(path), hf_model_loader(path)
    assert ours.config.dtype == torch.float32
    (prompt,) = _prompts(ours.config.vocab_size, [12])
    torch.testing.assert_close(ours.step([(0, prompt, 0)]), _hf_logits(hf, prompt),
                               atol=2e-5, rtol=1e-4)


BF16_CLEAR_MARGIN = 0.1
"""A top-2 logit gap this wide is no near tie for bf16: ~5x the largest bf16 logit error on these
models (ours and transformers' alike, ~0.02 for logits of std ~0.4)."""


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_bfloat16_matches_transformers(arch, make_checkpoint, hf_model_loader):
    """bf16 is a real CPU path (dtype auto picks it where the CPU has AVX512_BF16 or AMX; asked
    for here, it runs on any CPU, slowly without them). The checkpoint is bf16, so transformers
    in float32 computes its exact answer: our bf16 logits are within bf16 error of it and, on
    average, as close as transformers' own bf16 ones; greedy tokens match while its top-2
    margin is clear (at a near tie either token is a right bf16 answer; after a different one,
    the sequences part)."""
    path = make_checkpoint(arch, dtype=torch.bfloat16)
    ours, truth = PagedModel(path, dtype="bfloat16"), hf_model_loader(path)
    assert ours.config.dtype == torch.bfloat16
    assert {p.dtype for p in ours.model.parameters()} == {torch.bfloat16}
    theirs = type(truth).from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = _prompts(ours.config.vocab_size, [7, 19, 2, 33])
    logits = ours.step([(i, p, 0) for i, p in enumerate(prompts)])
    offset = 0
    for p in prompts:
        got, want = logits[offset:offset + len(p)], _hf_logits(truth, p)
        offset += len(p)
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
        their_error = (_hf_logits(theirs, p) - want).abs().mean().item()
        assert (got - want).abs().mean().item() <= 1.5 * their_error + 1e-3

    llm = LLM(str(path), dtype="bfloat16", block_size=BLOCK, kv_cache_memory=16 * 1024**2,
              progress=False)
    prompts = _prompts(ours.config.vocab_size, [3, 9, 17, 25, 5, 12], seed=7)  # short ones
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    compared = 0
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = truth.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                 max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        for token, expected, scores in zip(out.outputs[0].token_ids,
                                           ref.sequences[0, len(prompt):].tolist(), ref.scores):
            top2 = scores[0].topk(2).values
            clear = (top2[0] - top2[1]).item() >= BF16_CLEAR_MARGIN
            if token != expected:
                assert not clear, f"bf16 chose {token}, not {expected}, by a clear margin"
                break  # a near tie: the sequences part here, rightly
            compared += clear
    assert compared >= 16, f"only {compared} tokens had a clear margin: pick other prompts"


def test_unknown_architecture_names_supported_ones(make_checkpoint):
    path = make_checkpoint("Qwen3ForCausalLM")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MysteryForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MysteryForCausalLM.*supported: .*LlamaForCausalLM"):
        LLM(str(path), progress=False)


def test_unsupported_rope_scaling_is_refused(make_checkpoint):
    path = make_checkpoint("LlamaForCausalLM")
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    config.pop("rope_parameters", None)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="dynamic.*supported"):
        LLM(str(path), progress=False)
