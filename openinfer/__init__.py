"""openinfer: an open LLM inference engine."""

import importlib

from openinfer.huge_pages import request_huge_pages

request_huge_pages()  # before torch allocates anything (see openinfer/huge_pages.py)

from openinfer.logger import configure_logging  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]

_PUBLIC = {"LLM": "openinfer.llm", "SamplingParams": "openinfer.sampling_params",
           "RequestOutput": "openinfer.outputs", "CompletionOutput": "openinfer.outputs",
           "Logprob": "openinfer.outputs"}


def __getattr__(name: str):
    """The public classes, imported on first use: ``import openinfer`` (and so the CLI) stays
    free of torch, and `openinfer serve` starts its engine-core interpreter before importing
    it (openinfer.engine.core_launch)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'openinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


configure_logging()  # openinfer's INFO lines on stderr, as vLLM does (OPENINFER_CONFIGURE_LOGGING=0: off)
