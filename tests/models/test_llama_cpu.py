"""A Llama-family model's decoder layers in one C++ call per step (openinfer/models/llama_cpu.py)
give the Python layers' tokens and logprobs, bitwise, on every GEMM path it calls; models and
steps it does not cover run the Python layers."""

from __future__ import annotations

import pytest
import torch
from conftest import fp8_checkpoint

from openinfer import LLM, SamplingParams
from openinfer.kernels.gemm_plan import ENV_VAR as GEMM_ENV

PROMPTS = [[5 + i for i in range(n)] for n in (3, 40, 17, 9, 150)]
"""The first step prefills 219 rows: a prefill-sized call that paths building per row count
(oneDNN's, torch's bf16) run on rows padded to a multiple of 32."""


class CountingLayers:
    """A stack's C++ layers, counting the steps they ran."""

    def __init__(self, layers) -> None:
        self.layers, self.calls = layers, 0

    def covers(self, rows: int) -> bool:
        return self.layers.covers(rows)

    def __call__(self, *args):
        self.calls += 1
        return self.layers(*args)


def _generate(llm: LLM) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def _one_call_vs_python(path, dtype: torch.dtype, gemm_label: str = "") -> int:
    llm = LLM(str(path), attention_backend="cpu", dtype=str(dtype).removeprefix("torch."),
              kv_cache_memory=8 << 20, progress=False, enable_prefix_caching=False)
    assert llm.engine.core.compute_info["gemm"].endswith(gemm_label)
    stack = llm.engine.core.executor.worker.model.model
    _generate(llm)  # builds the call at the first step
    counting = stack.cpu_layers[dtype] = CountingLayers(stack.cpu_layers[dtype])
    one_call = _generate(llm)
    stack.cpu_layers[dtype] = None  # the Python layers
    assert one_call == _generate(llm)
    return counting.calls


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_call_gives_the_python_layers_bits(kernels, make_checkpoint, monkeypatch, arch, dtype):
    """Qwen3 (q/k norms), Llama (none), Qwen2 (q/k/v biases); with every GEMM on torch's plain
    path, so that the call covers every step on any CPU."""
    monkeypatch.setenv(GEMM_ENV, "torch")
    path = make_checkpoint(arch, num_layers=2, dtype=dtype)
    assert _one_call_vs_python(path, dtype) >= 6  # prefills and decodes


@pytest.mark.parametrize("gemm,dtype", [("torch_t", torch.float32), ("mkl_packed", torch.float32),
                                        ("small_gemm", torch.float32), ("amx", torch.bfloat16),
                                        ("onednn", torch.float32), ("onednn_packed", torch.bfloat16)])
def test_each_gemm_path_the_call_runs(kernels, make_checkpoint, monkeypatch, gemm, dtype):
    if gemm == "mkl_packed" and not kernels.mkl_gemm_available():
        pytest.skip("no MKL packed GEMM in this torch")
    if gemm == "amx" and not kernels.amx_gemm_available():
        pytest.skip("no AMX here")
    if gemm == "onednn_packed" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no bf16 oneDNN kernels on this CPU")
    monkeypatch.setenv(GEMM_ENV, gemm)
    path = make_checkpoint("Qwen3ForCausalLM", num_layers=2, dtype=dtype)
    assert _one_call_vs_python(path, dtype) >= 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_weights_kept_as_loaded(kernels, make_checkpoint, tmp_path, dtype):
    """A block-scaled fp8 checkpoint's layers: decode steps (up to the fp8 kernel's 16 rows)
    run in the one call, the 219-row prefill in the Python layers."""
    path = fp8_checkpoint(make_checkpoint("Qwen3ForCausalLM", num_layers=2, dtype=dtype),
                          tmp_path / "fp8", 16)
    assert _one_call_vs_python(path, dtype, gemm_label="+fp8") >= 5


def test_models_and_steps_it_does_not_cover_run_the_python_layers(kernels, make_checkpoint):
    path = make_checkpoint("Qwen3ForCausalLM", num_layers=2)
    llm = LLM(str(path), attention_backend="cpu", kv_cache_memory=8 << 20, progress=False,
              batch_invariant=True)  # its own GEMM orientation and reduction order
    _generate(llm)
    assert llm.engine.core.executor.worker.model.model.cpu_layers == {torch.float32: None}
    gemma = make_checkpoint("Gemma2ForCausalLM", num_layers=2)  # its own layer class
    llm = LLM(str(gemma), attention_backend="cpu", kv_cache_memory=8 << 20, progress=False)
    _generate(llm)
    assert llm.engine.core.executor.worker.model.model.cpu_layers == {torch.float32: None}
