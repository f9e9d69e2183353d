"""Shared fixtures: small random-weight Hugging Face checkpoints built with transformers."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import settings
from safetensors.torch import load_file, save_file

import openinfer.llm
from openinfer.config import CPU_KV_CACHE_MEMORY_ENV
from openinfer.demo import build_demo_tokenizer
from openinfer.engine.core import EngineCore

# The KV pool of every engine the suite builds without --kv-cache-memory, in this process and
# in the servers it starts. The CPU default (2 GiB) is zeroed at start: 1.5-2 s per engine on
# a VM that hands freed memory back to its host (fresh pages fault in at about 1 GB/s there),
# which made three engine test files take 131 s instead of 22; and six servers at once beside
# the suite's own engines ran a 24 GiB machine out of memory. 64 MiB (8192 blocks of the tiny
# Qwen3): a fresh process zeroes it in ~0.1 s where 256 MiB took 0.5 s.
os.environ.setdefault(CPU_KV_CACHE_MEMORY_ENV, "64MiB")

# Property tests draw the same examples on every run, so a failure in a CI log reproduces;
# OPENINFER_HYPOTHESIS=explore draws new ones (a failure then prints its @reproduce_failure).
# Loaded here, before the test modules: their @settings inherit it.
settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("OPENINFER_HYPOTHESIS", "reproducible"))

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@pytest.fixture(scope="session")
def kernels():
    """The CPU kernel extension; the test is skipped where it cannot be built (no compiler)."""
    from openinfer.kernels.cpu_attention import load_cpu_attention

    ext = load_cpu_attention()
    if ext is None:
        pytest.skip("the CPU kernel extension cannot be built here")
    return ext


@pytest.fixture(scope="session")
def tokenizer():
    return build_demo_tokenizer(1024)


def _hf_classes(arch: str):
    family = arch.removesuffix("ForCausalLM")
    return getattr(transformers, f"{family}Config"), getattr(transformers, arch)


def build_checkpoint(
    path: Path,
    arch: str,
    tokenizer,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 512,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    extra_config: dict | None = None,
) -> Path:
    """A random-weight checkpoint (GQA, a few layers) plus tokenizer, saved to ``path``;
    ``extra_config``: more config fields (experts, MLA ranks, ...)."""
    config_cls, model_cls = _hf_classes(arch)
    vocab = vocab_size or -(-len(tokenizer) // 64) * 64
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos, bos_token_id=pad, pad_token_id=pad, initializer_range=0.05,
    )
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling)
    kwargs.update(extra_config or {})
    config = config_cls(**kwargs)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # non-unit norm weights, so a forgotten norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
    model = model.to(dtype)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def make_checkpoint(tmp_path, tokenizer) -> Callable[..., Path]:
    counter = iter(range(1000))

    def make(arch: str = "Qwen3ForCausalLM", **kwargs) -> Path:
        return build_checkpoint(tmp_path / f"ckpt{next(counter)}", arch, tokenizer, **kwargs)

    return make


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory, tokenizer) -> Path:
    """One shared tiny Qwen3 checkpoint for tests that do not care about architecture."""
    return build_checkpoint(tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM", tokenizer,
                            num_layers=2)


def load_hf_model(path: Path) -> torch.nn.Module:
    _, model_cls = _hf_classes(transformers.AutoConfig.from_pretrained(path).architectures[0])
    return model_cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture
def hf_model_loader() -> Callable[[Path], torch.nn.Module]:
    return load_hf_model


class _EngineRegistry:
    """Every EngineCore built in this process: those a test built, and (weakly) those built
    outside any test, by module- or session-scoped fixtures, which later tests share."""

    def __init__(self) -> None:
        self.of_test: list[EngineCore] | None = None
        self.shared: weakref.WeakSet[EngineCore] = weakref.WeakSet()

    def record(self, core: EngineCore) -> None:
        if self.of_test is not None:
            self.of_test.append(core)
        else:
            self.shared.add(core)


_ENGINES = _EngineRegistry()


@pytest.fixture(scope="session", autouse=True)
def record_engines():
    original_init = EngineCore.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _ENGINES.record(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineCore, "__init__", recording_init)
        yield


def assert_idle(core: EngineCore) -> None:
    """No request left, no block held, the runner holding no finished request's state.
    An engine whose worker processes have ended (shut down, or failed on purpose: a rank
    killed) is left as it was."""
    if not core.executor.alive:
        return
    core.check_integrity()
    assert not core.has_unfinished_requests(), "a request was left in the engine"
    assert core.kv.pool.num_free == core.kv.pool.num_blocks, "KV blocks leaked"
    assert not any(core.executor.collective_rpc("runner_request_ids")), (
        "the runner kept a finished request")


@pytest.fixture(autouse=True)
def check_block_pools_after_test(record_engines):
    """After every test, every engine it built is idle, and so is every engine that
    fixtures built for tests to share."""
    _ENGINES.of_test = built = []
    try:
        yield
    finally:
        _ENGINES.of_test = None
    for core in [*built, *_ENGINES.shared]:
        assert_idle(core)


def run_disaggregated(path: Path, prompts: list[list[int]], params: dict,
                      **options) -> tuple[list[list[int]], openinfer.llm.LLM, openinfer.llm.LLM]:
    """One prefill instance and one decode instance (TCP pulls), in process: the prompts are
    prefilled on the first, handed over and decoded on the second. Returns the decoded tokens
    and both engines (shut down), once the prefill side has released every lease."""
    import time

    from openinfer import LLM, SamplingParams

    prefill = LLM(str(path), kv_role="prefill", progress=False, **options)
    decode = LLM(str(path), kv_role="decode", kv_connector="tcp", progress=False, **options)
    try:
        outs = prefill.generate(prompts, SamplingParams(temperature=0, max_tokens=1,
                                                        kv_transfer_params={"do_remote_decode": True}))
        handoff = [SamplingParams(**params, kv_transfer_params=o.kv_transfer_params) for o in outs]
        tokens = [o.outputs[0].token_ids for o in decode.generate(prompts, handoff)]
        held = prefill.engine.core  # the prefill side frees its leases once they are pulled
        deadline = time.monotonic() + 5
        while held.kv.num_held and time.monotonic() < deadline:
            time.sleep(0.02)
            held.connector.collect_leases()
        assert held.kv.num_held == 0
    finally:
        prefill.engine.core.shutdown()
        decode.engine.core.shutdown()
    return tokens, prefill, decode


SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# A tiny DeepSeek-V4 with every layer type (sliding, CSA with its indexer, HCA) and hash and
# score-routed MoE layers.
DEEPSEEK_V4 = dict(
    q_lora_rank=32, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=8,
    moe_intermediate_size=32, layer_types=[SLIDING, CSA, HCA, CSA],
    compress_rates={CSA: 4, HCA: 8}, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
    index_topk=64, hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=1.0,
)


def randomize_v4(path) -> None:
    """transformers initialises sinks, position biases, mHC biases and scales, the expert-score
    bias and tid2eid to constants: random values make every path matter."""
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(11)
    for name, t in tensors.items():
        if name.endswith(("attn_sink", ".ape", "_base")):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.5
        elif name.endswith("_scale"):
            tensors[name] = torch.rand(t.shape, generator=g) * 1.5 + 0.5
        elif name.endswith("gate.bias"):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.1
        elif name.endswith("tid2eid"):
            experts = DEEPSEEK_V4["n_routed_experts"]
            tensors[name] = torch.stack([torch.randperm(experts, generator=g)[:t.shape[1]]
                                         for _ in range(t.shape[0])])
    save_file(tensors, file, metadata={"format": "pt"})


# Llama with one KV head (replicated on both ranks), q/k/v/o and MLP biases (the row-parallel
# bias added once), tied embeddings and an odd vocabulary (the vocab shards padded);
# Qwen3-MoE with two KV heads (split), q/k norms, an untied LM head, a dense MLP in layer 0
# and 8 experts (top 3) in layer 1; DeepSeek-V3 with MLA (heads split, the latent cache
# whole on both ranks), a dense first layer, then 8 routed experts and a shared one;
# DeepSeek-V4 (heads, sinks and output groups split; its one KV head, compressors and
# indexer whole on both ranks).
CHECKPOINTS = {
    "llama": dict(arch="LlamaForCausalLM", num_kv_heads=1, tie_word_embeddings=True,
                  vocab_size=1031, extra_config={"attention_bias": True, "mlp_bias": True}),
    "qwen3_moe": dict(arch="Qwen3MoeForCausalLM", num_kv_heads=2, extra_config=dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, mlp_only_layers=[0],
        decoder_sparse_step=1, norm_topk_prob=True)),
    "deepseek_v3": dict(arch="DeepseekV3ForCausalLM", num_kv_heads=4, extra_config=dict(
        kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5)),
    "deepseek_v4": dict(arch="DeepseekV4ForCausalLM", num_layers=4, num_kv_heads=1, head_dim=32,
                        intermediate_size=32, extra_config=DEEPSEEK_V4),
}


@pytest.fixture(scope="session")
def parallel_checkpoints(tmp_path_factory, tokenizer):
    """The CHECKPOINTS, built once: the multi-rank tests' models."""
    paths = {name: build_checkpoint(tmp_path_factory.mktemp(name), options["arch"], tokenizer,
                                    **{k: v for k, v in options.items() if k != "arch"})
             for name, options in CHECKPOINTS.items()}
    randomize_v4(paths["deepseek_v4"])
    return paths


def quantize_blocks(t: torch.Tensor, block: int, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 values and per-tile scales (what DeepSeek's checkpoints store); ``ue8m0``: each
    scale a power of two, stored as float8_e8m0fnu (DeepSeek-V3.1's and V4's scale format)."""
    n, k = t.shape
    rows, cols = -(-n // block), -(-k // block)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = t[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
    if ue8m0:
        scale = torch.exp2(torch.log2(scale).ceil())
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    q = (t / full).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K / 2], float8_e8m0fnu [N, K / 32]): each run of 32 inputs scaled by
    the power of two that brings its largest magnitude to at most 6, then rounded to the
    nearest e2m1 value; element 2j in byte j's low nibble."""
    n, k = t.shape
    groups = t.float().reshape(n, k // 32, 32)
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-12) / 6)))
    x = groups / scale[..., None]
    codes = ((x.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(-1) | ((x < 0).long() << 3))
    codes = codes.reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def fp8_checkpoint(src: Path, dst: Path, block: int) -> Path:
    """A copy of the checkpoint at ``src`` in DeepSeek-V3's FP8 release format: every
    projection (experts' included) as e4m3 with a weight_scale_inv per ``block`` tile."""
    import json
    import shutil

    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = {}
        for name, t in load_file(file).items():
            if t.dim() == 2 and name.endswith("proj.weight"):
                tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(t, block)
            else:
                tensors[name] = t
        save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst
