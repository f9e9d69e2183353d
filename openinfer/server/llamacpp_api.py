"""What llama.cpp's server users reach for: a chat page at ``GET /`` (static/chat.html and
chat.js: a streamed conversation over /v1/chat/completions), and the introspection their
tools and scripts read: ``GET /props`` (the model, its context, chat template and special
tokens, the default sampling settings, how many requests run at once) and ``GET /slots``
(the requests in flight). openinfer batches continuously and has no fixed slots:
``total_slots`` is the most requests it runs at once (``--max-num-seqs``), and ``/slots``
lists one entry per request in flight, without its text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse

import openinfer
from openinfer.engine.async_llm import AsyncLLM
from openinfer.sampling_params import SamplingParams

STATIC = Path(__file__).parent / "static"


def _sampling(params: SamplingParams | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """Sampling settings under llama.cpp's names (a request's, or the server's defaults)."""
    def pick(name: str, fallback: Any) -> Any:
        return getattr(params, name) if params is not None else defaults.get(name, fallback)

    max_tokens = pick("max_tokens", None)
    return {"temperature": pick("temperature", 1.0), "top_p": pick("top_p", 1.0),
            "top_k": pick("top_k", 0), "min_p": pick("min_p", 0.0),
            "repeat_penalty": pick("repetition_penalty", 1.0),
            "n_predict": -1 if max_tokens is None else max_tokens,
            "seed": pick("seed", None)}


def install_llamacpp_routes(app: FastAPI, llm: AsyncLLM, served_model_name: str,
                            sampling_defaults: dict[str, Any] | None) -> None:
    config, defaults = llm.config, sampling_defaults or {}

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC / "chat.html", media_type="text/html")

    @app.get("/chat.js", include_in_schema=False)
    async def chat_script() -> FileResponse:
        return FileResponse(STATIC / "chat.js", media_type="text/javascript")

    @app.get("/props")
    async def props() -> dict:
        tokenizer = llm.tokenizer
        return {
            "default_generation_settings": {"n_ctx": config.model.max_model_len,
                                            "params": _sampling(None, defaults)},
            "total_slots": config.scheduler.max_num_seqs,
            "model_alias": served_model_name, "model_path": str(config.model.path),
            "chat_template": getattr(tokenizer, "chat_template", None) or "",
            "bos_token": getattr(tokenizer, "bos_token", None),
            "eos_token": getattr(tokenizer, "eos_token", None),
            "modalities": {"vision": False, "audio": False},
            "build_info": f"openinfer {openinfer.__version__}"}

    @app.get("/slots")
    async def slots() -> list[dict]:
        return [{"id": i, "id_task": r.request_id, "n_ctx": config.model.max_model_len,
                 "is_processing": True, "n_prompt_tokens": r.num_prompt_tokens,
                 "n_decoded": r.num_generated_tokens, "params": _sampling(r.params, defaults)}
                for i, r in enumerate(llm.output_processor.in_flight())]
