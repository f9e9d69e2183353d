"""Where a decode step's time goes: Python around the model vs the model itself.

Runs batch-B decode steps (after the prompts are prefilled) through ``openinfer.LLM`` and
times, per step, the engine's parts by wrapping them in place (no copy of the engine):

    schedule      Scheduler.schedule()                     pure Python
    prepare       the runner's input building up to the model call (diff, ids, metadata)
    forward       the model's forward pass: kernels, and the host time around them
    sample        logits (the LM head GEMM) + sampler       torch + a little Python
    update        Scheduler.update_from_output()           pure Python
    output        the output processor (detokenize, stops)  pure Python
    other         the rest of LLMEngine.step

The forward and sampling are split further into the time inside compute kernels (every
entry point of the CPU kernel extension and every GEMM plan's path, timed where the model
holds them; outermost call only) and the host time around them: Python, torch's dispatch,
allocation. "Python overhead" = schedule + prepare + update + output + other + the forward's
host time. The figures are fractions of one step, so they hold on a noisy machine better
than absolute times do. The timers add ~0.3 us per kernel call (~0.1 ms per step), counted
as host time.

    .venv/bin/python benchmarks/bench_step_overhead.py [--model DIR] [--batch 32] [--steps 64]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from doc_sections import write_section
from offline_limits import cpu_model

from openinfer import LLM, SamplingParams
from openinfer.cpu_features import cpu_capability
from openinfer.engine.llm_engine import LLMEngine
from openinfer.engine.output_processor import OutputProcessor
from openinfer.engine.scheduler import Scheduler
from openinfer.kernels import cpu_attention, gemm_paths
from openinfer.layers.attention import Attention
from openinfer.worker.runner import ModelRunner

REPO = Path(__file__).resolve().parent.parent
PEERS_MODELS = [Path("/root/.cache/openinfer-peers/models/qwen3-0.4b-random-fp32"),
                Path("/root/.cache/openinfer-peers/models/qwen3-0.4b-random")]  # float32, bfloat16


def given_or_peers_models(given: list[str] | None) -> list[str]:
    """The checkpoints given by --model, or else the peers' that exist; exits if none."""
    models = given or [str(p) for p in PEERS_MODELS if p.exists()]
    if not models:
        sys.exit("--model: no checkpoint given and the peers checkpoints are absent")
    return models


class StepClock:
    """Accumulates seconds per part while ``enabled``; kernel calls (``kernel``) count as
    ``kernels in <part>`` of the innermost part running."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False
        self.parts: list[str] = []  # the wrapped calls running, outermost first
        self.in_kernel = False

    def wrap(self, owner: object, name: str, part: str) -> None:
        """Time ``owner.name`` (a class's method, or an instance's bound one) as ``part``."""
        original = getattr(owner, name)
        clock = self

        def timed(*args, **kwargs):
            if not clock.enabled:
                return original(*args, **kwargs)
            clock.parts.append(part)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                clock.seconds[part] += time.perf_counter() - start
                clock.parts.pop()

        setattr(owner, name, timed)

    def kernel(self, fn):
        """``fn``, its calls timed as kernel time, unless made inside another kernel call (a
        GEMM path calling the extension counts once)."""
        clock = self

        def call(*args, **kwargs):
            if not clock.enabled or clock.in_kernel:
                return fn(*args, **kwargs)
            clock.in_kernel = True
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.seconds[f"kernels in {clock.parts[-1] if clock.parts else 'step'}"] += (
                    time.perf_counter() - start)
                clock.in_kernel = False

        return call


class TimedModule:
    """The CPU kernel extension with every function timed as ``kernels`` (classes pass
    through: making a per-step or per-layer object is host work)."""

    def __init__(self, module, clock: StepClock) -> None:
        self._module, self._clock = module, clock

    def __getattr__(self, name: str):
        attr = getattr(self._module, name)
        return attr if isinstance(attr, type) or not callable(attr) else self._clock.kernel(attr)


class TimedLayers:
    """A decoder stack's one C++ call (models/llama_cpu.py), timed as kernel time: no Python
    runs inside it."""

    def __init__(self, layers, timed) -> None:
        self.covers, self._timed = layers.covers, timed

    def __call__(self, *args):
        return self._timed(*args)


def time_kernels(clock: StepClock, model: torch.nn.Module) -> None:
    """Route the model's kernel calls through ``clock``: the extension (held by the layers, by
    the GEMM paths and by the attention backend), a decoder stack's one call, each layer's fused
    attention call and each GEMM plan's paths (torch's own GEMMs included; the LM head's too)."""
    ext = cpu_attention.load_cpu_attention()
    if ext is not None:
        proxy = TimedModule(ext, clock)
        cpu_attention._built["native"] = proxy
        gemm_paths._amx_kernels.cache_clear()
        gemm_paths._mkl_kernels.cache_clear()
    for module in model.modules():
        if ext is not None and getattr(module, "cpu_kernels", None) is not None:
            module.cpu_kernels = proxy
        for dtype, layers in getattr(module, "cpu_layers", {}).items():  # a stack's one C++ call
            if layers is not None:
                module.cpu_layers[dtype] = TimedLayers(layers, clock.kernel(layers))
        if isinstance(module, Attention):
            for dtype, kernel in module.rope_kernels.items():
                if kernel is not None:
                    module.rope_kernels[dtype] = clock.kernel(kernel)
        plan = getattr(module, "plan", None)
        if plan is not None:
            plan._table = [(rows, clock.kernel(run), weight, pads)
                           for rows, run, weight, pads in plan._table]


def measure(model: str, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    clock = StepClock()
    clock.wrap(Scheduler, "schedule", "schedule")
    clock.wrap(Scheduler, "update_from_output", "update")
    clock.wrap(OutputProcessor, "process", "output")
    clock.wrap(ModelRunner, "execute", "execute")
    clock.wrap(ModelRunner, "sample", "sample")
    clock.wrap(LLMEngine, "step", "step")
    llm = LLM(model, progress=False, enable_prefix_caching=False)
    runner = llm.engine.core.executor.worker.runner
    # An instance attribute: nn.Module.__call__ finds it.
    clock.wrap(runner.model, "forward", "forward")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.scheduler.requests.values()):
        engine.step()  # prefill, untimed
    for _ in range(4):
        engine.step()  # warm-up decodes (each layer's fused attention call is made by now)
    time_kernels(clock, runner.model)
    clock.enabled = True
    for _ in range(steps):
        engine.step()
    clock.enabled = False
    while engine.has_unfinished_requests():
        engine.step()
    s = defaultdict(float, {k: v / steps for k, v in clock.seconds.items()})
    parts = {
        "schedule": s["schedule"],
        "prepare": s["execute"] - s["forward"],
        "forward: kernels": s["kernels in forward"],
        "forward: host": s["forward"] - s["kernels in forward"],
        "sample: LM head GEMM": s["kernels in sample"],
        "sample: the rest": s["sample"] - s["kernels in sample"],
        "update": s["update"],
        "output": s["output"],
    }
    parts["other"] = s["step"] - sum(parts.values())
    parts["step"] = s["step"]
    return parts


PYTHON_PARTS = ("schedule", "prepare", "forward: host", "update", "output", "other")
"""Host work of a step outside its kernels; the sampler's remaining torch ops and Python
(``sample: the rest``) are shown apart."""


def table(model: str, batch: int, prompt_len: int, steps: int) -> str:
    parts = measure(model, batch, prompt_len, steps)
    step = parts.pop("step")
    python = sum(parts[name] for name in PYTHON_PARTS)
    outside = python - parts["forward: host"]
    rows = [f"| {name} | {seconds * 1e3:.2f} | {seconds / step:.1%} |" for name, seconds in parts.items()]
    return "\n".join([
        f"Model `{Path(model).name}` (dtype auto):",
        "",
        "| part | ms per step | share |",
        "|---|---|---|",
        *rows,
        f"| **step** | {step * 1e3:.2f} | 100% |",
        "",
        f"Python overhead ({' + '.join(PYTHON_PARTS)}): **{python / step:.1%}** of a step; "
        f"{outside / step:.1%} outside the forward.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append",
                        help="a checkpoint (repeatable; default: the peers' float32 and bfloat16 "
                             "checkpoints that exist)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    models = given_or_peers_models(args.model)
    tables = [table(model, args.batch, args.prompt_len, args.steps) for model in models]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    body = "\n".join([
        "## Decode step: Python overhead (benchmarks/bench_step_overhead.py)",
        "",
        f"Batch {args.batch} decode after {args.prompt_len}-token prompts, {args.steps} steps, "
        f"{torch.get_num_threads()} threads. CPU: {cpu_model()} ({cpu_capability()}); "
        f"commit {commit}.",
        "",
        "\n\n".join(tables),
    ])
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_step_overhead", body)


if __name__ == "__main__":
    main()
