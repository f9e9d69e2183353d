"""The server's sampling defaults (``--generation-config``) and chat template (``--chat-template``).

``auto`` takes the model's ``generation_config.json`` (how its authors want it sampled,
e.g. Qwen3's temperature 0.6, top_p 0.95), ``vllm`` takes none (OpenAI's defaults), a
path names a folder holding a ``generation_config.json`` (or the file itself). Only
the fields vLLM reads are used; a request's own values always win.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# generation_config.json field -> request field it provides a default for.
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}


def sampling_defaults(model_path: str, option: str = "auto") -> dict:
    """Request-field defaults from ``option`` (see the module docstring)."""
    if option == "vllm":
        return {}
    if option == "auto":
        file = Path(model_path) / "generation_config.json"
        if not file.is_file():  # a GGUF file, or a checkpoint without one
            return {}
    else:
        file = Path(option)
        if file.is_dir():
            file = file / "generation_config.json"
        if not file.is_file():
            raise ValueError(f"--generation-config: no generation_config.json at {option!r} "
                             "(give auto, vllm, or a folder holding one)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: cannot read {str(file)!r}: {e}") from None
    defaults = {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items()
                if config.get(theirs) is not None}
    if defaults:
        logger.info("sampling defaults from %s (requests override them): %s", file, defaults)
    return defaults


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file holding a Jinja template, or the template itself."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
