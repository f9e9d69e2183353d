"""Schemathesis over the server's and the router's own /openapi.json: requests generated
from each documented route (valid ones, and invalid ones derived from the schema) against
real processes. None may get a 5xx, and the engine must come out alive and idle."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
from server_process import ADMIN_KEY, MODEL, metrics, start_router, start_server, stop  # noqa: E402

EXAMPLES_PER_ROUTE = 20
MAX_MODEL_LEN = 64
"""The fuzzed server's context: room for the generated prompts (about a dozen tokens of chat
template)."""
DEFAULT_MAX_TOKENS = 4
"""The fuzzed server's max_tokens for requests that give none."""


SMALLER = {"n": 2, "best_of": 2, "max_tokens": 8, "max_completion_tokens": 8, "min_tokens": 8,
           "logprobs": 3, "top_logprobs": 3, "prompt_logprobs": 3}
"""Bounds tighter than the server's, for the fuzzer's valid requests only: its boundary
values would otherwise ask the 2-core CI box for 128 samples of 500 tokens per case."""


def _narrow(spec: dict) -> dict:
    """The served model's name as the only valid `model` (most generated requests then get
    past the model lookup to the engine; the coverage phase still sends other names), and
    the SMALLER bounds on work per request."""
    for schema in spec.get("components", {}).get("schemas", {}).values():
        properties = schema.get("properties", {})
        if "model" in properties:
            properties["model"] = {"type": "string", "enum": [MODEL]}
        for name, bound in SMALLER.items():
            if name in properties:
                properties[name] = _bounded(properties[name], bound)
    return spec


def _bounded(prop: dict, bound: int) -> dict:
    """``prop`` with every integer alternative capped at ``bound``."""
    if prop.get("type") == "integer":
        return {**prop, "maximum": min(bound, prop.get("maximum", bound))}
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return {**prop, key: [_bounded(p, bound) for p in prop[key]]}
    return prop


def _check_documented_errors(spec: dict) -> None:
    """Invalid requests are answered 400 with an OpenAI error body: the schema says so, and
    not FastAPI's default 422 with its HTTPValidationError."""
    assert '"422"' not in json.dumps(spec) and "HTTPValidationError" not in json.dumps(spec)
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
        bad = spec["paths"][path]["post"]["responses"]["400"]
        assert bad["content"]["application/json"]["schema"] == error


def _start_fuzz(url: str, tmp_path: Path, name: str) -> subprocess.Popen:
    """Schemathesis against ``url``, running."""
    spec = json.loads(urllib.request.urlopen(f"{url}/openapi.json", timeout=30).read())
    _check_documented_errors(spec)
    workdir = tmp_path / name  # its cache dir goes there
    workdir.mkdir()
    (workdir / "openapi.json").write_text(json.dumps(_narrow(spec)))
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "st"), "run", "openapi.json", "--url", url,
         "--checks", "not_a_server_error", "--max-examples", str(EXAMPLES_PER_ROUTE),
         "--seed", "1", "--header", f"Authorization: Bearer {ADMIN_KEY}",
         "--request-timeout", "120", "--continue-on-failure", "--no-color"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=workdir)


def _cases(run: subprocess.Popen, name: str) -> int:
    """The number of cases a finished run generated; it must have found no failure."""
    out, _ = run.communicate(timeout=900)
    assert run.returncode == 0, f"{name}:\n{out[-8000:]}"
    generated = re.search(r"(\d+) generated", out)
    assert generated, out[-2000:]
    return int(generated.group(1))


@pytest.mark.slow
def test_generated_requests_never_get_a_5xx_nor_kill_the_engine(qwen3_checkpoint, tmp_path):
    # A generated request without max_tokens generates what the server's default allows: to
    # the context's end, the ~250 such requests through the router took 108 of its 120 s
    # (2 Intel cores). The model's generation config (as vLLM's --generation-config) caps it.
    generation = tmp_path / "generation"
    generation.mkdir()
    (generation / "generation_config.json").write_text(json.dumps({"max_new_tokens": DEFAULT_MAX_TOKENS}))
    base, server = start_server(qwen3_checkpoint, "--max-model-len", str(MAX_MODEL_LEN),
                                "--generation-config", str(generation))
    router, router_proc = start_router([base], qwen3_checkpoint)
    runs: dict[str, subprocess.Popen] = {}
    try:
        # Both at once: the fuzzer's own work overlaps the server's, and the engine takes
        # the two streams of odd requests together.
        for name, url in (("server", base), ("router", router)):
            runs[name] = _start_fuzz(url, tmp_path, name)
        cases = {name: _cases(run, name) for name, run in runs.items()}
        assert cases["server"] >= 500 and cases["router"] >= 500, cases
        health = json.loads(urllib.request.urlopen(f"{base}/health", timeout=30).read())
        assert health == {"status": "ok", "engine_restarts": 0}
        values = metrics(base)
        assert values["openinfer:num_requests_running"] == 0
        assert values["openinfer:kv_cache_usage_perc"] == 0
    finally:
        for run in runs.values():
            run.kill()
        stop(router_proc)
        stop(server)
