"""DeepSeek-V3's MTP module as a drafter: its first draft is what the module computes from
transformers' hidden states (the module run through transformers' own decoder layer), and
greedy tokens equal plain decoding's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from openinfer import LLM, SamplingParams

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
           moe_intermediate_size=32, num_experts_per_tok=2, q_lora_rank=24, n_routed_experts=8,
           n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
           norm_topk_prob=True, routed_scaling_factor=2.5)


@pytest.fixture(scope="module")
def v3_with_mtp(tmp_path_factory, tokenizer):
    from conftest import build_checkpoint

    path = build_checkpoint(tmp_path_factory.mktemp("v3mtp"), "DeepseekV3ForCausalLM", tokenizer,
                            num_kv_heads=4, extra_config=MLA)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    config = json.loads((path / "config.json").read_text())
    n = config["num_hidden_layers"]
    g = torch.Generator().manual_seed(5)
    # The MTP block: a copy of the last decoder block (so the reference can run it through
    # transformers' layer), plus the module's own parts.
    mtp = {f"model.layers.{n}.{k.split('.', 3)[3]}": v.clone()
           for k, v in tensors.items() if k.startswith(f"model.layers.{n - 1}.")}
    hidden = tensors["model.norm.weight"].shape[0]
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    for part, shape in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                        ("eh_proj.weight", (hidden, 2 * hidden)), ("embed_tokens.weight", (vocab, hidden)),
                        ("shared_head.norm.weight", (hidden,)), ("shared_head.head.weight", (vocab, hidden))):
        scale = 1.0 if part.endswith("norm.weight") else 0.05
        mtp[f"model.layers.{n}.{part}"] = (1.0 if scale == 1.0 else 0.0) + scale * torch.randn(
            shape, generator=g)
    save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return path, mtp, n


def _reference_first_draft(model, mtp: dict, n: int, prompt: list[int], sampled: int) -> int:
    """The MTP module's prediction after the prompt, through transformers (``model``): the
    main model's final (normed) hidden states, the tokens shifted by one (the sampled token
    last, the embedding at position 0 zeroed), eh_proj, transformers' decoder layer, the
    shared head."""
    config = model.config
    block = model.model.layers[n - 1]  # the MTP block's weights are a copy of it
    prefix = f"model.layers.{n}."

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    with torch.no_grad():
        ids = torch.tensor([prompt])
        h = model.model(ids).last_hidden_state
        shifted = torch.tensor([prompt[1:] + [sampled]])
        e = rms(torch.nn.functional.embedding(shifted, mtp[prefix + "embed_tokens.weight"]),
                mtp[prefix + "enorm.weight"])
        e[:, 0] = 0
        x = torch.cat([e, rms(h, mtp[prefix + "hnorm.weight"])], -1) @ mtp[prefix + "eh_proj.weight"].T
        positions = torch.arange(len(prompt)).unsqueeze(0)
        out = block(x, position_ids=positions,
                    position_embeddings=model.model.rotary_emb(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        logits = rms(out, mtp[prefix + "shared_head.norm.weight"]) @ mtp[prefix + "shared_head.head.weight"].T
    return int(logits[0, -1].argmax())


def test_mtp_drafts_match_the_module_and_greedy_tokens_match_plain_decoding(v3_with_mtp):
    path, mtp, n = v3_with_mtp
    prompts = [[5 + (7 * i + 3 * j) % 900 for j in range(9 + 5 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(path), progress=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(path), progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    core = llm.engine.core
    first_drafts = {}
    update = core.scheduler.update_from_output

    def capture(scheduled, result):
        for request_id, draft in result.drafts.items():
            req = core.scheduler.requests.get(request_id)
            if req is not None and not req.output_token_ids and draft.token_ids:
                first_drafts[tuple(req.prompt_token_ids)] = (
                    result.sampled_token_ids[request_id][0], draft.token_ids[0])
        return update(scheduled, result)

    core.scheduler.update_from_output = capture
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = core.stats()
    assert stats["spec_num_draft_tokens"] > 0
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").eval()
    for prompt in prompts[:2]:
        sampled, draft = first_drafts[tuple(prompt)]
        assert draft == _reference_first_draft(hf, mtp, n, prompt, sampled)
    llm.engine.check_integrity()


def test_mtp_needs_a_model_with_mtp_weights(qwen3_checkpoint):
    with pytest.raises(ValueError, match="no MTP module"):
        LLM(str(qwen3_checkpoint), progress=False,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_mtp_split_over_two_ranks_drafts_as_one(v3_with_mtp):
    """Under TP=2 the MTP module is split over the ranks like the model (its MLA by heads,
    its experts' features, its head by vocabulary): the drafts, so the accepted counts, are
    one rank's, and the greedy tokens plain decoding's."""
    path, _, _ = v3_with_mtp
    prompts = [[5 + (7 * i + 3 * j) % 900 for j in range(9 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    expected = [o.outputs[0].token_ids
                for o in LLM(str(path), progress=False).generate(prompts, params)]
    runs = {}
    for size in (1, 2):
        llm = LLM(str(path), progress=False, tensor_parallel_size=size, speculative_config=spec)
        try:
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
            stats = llm.engine.core.stats()
            runs[size] = (stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"])
        finally:
            llm.engine.core.shutdown()
    assert runs[2] == runs[1] and runs[1][0] > 0
