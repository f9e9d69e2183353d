"""The tokenizer `openinfer bench serve` builds prompts with: a local one, or the server's.

Workloads and the prefix-cache oracle need three things from a tokenizer, each batched so a
remote tokenizer can answer hundreds of texts without hundreds of sequential round trips:

* ``encode(texts)``: token ids of plain texts, no special tokens added;
* ``decode(token_lists)``: the texts of token-id lists;
* ``render_chat(conversations, add_generation_prompt)``: token ids of chat conversations
  rendered with the model's chat template (the template holds its own special tokens).

:class:`LocalTokenizer` wraps a Hugging Face tokenizer (``--tokenizer``). :class:`ServerTokenizer`
asks the server's ``POST /tokenize`` and ``POST /detokenize``, the API vLLM serves and
openinfer serves too, so ``bench serve`` needs no tokenizer files. Both answer identically for
the same tokenizer, so a workload does not depend on where its tokenizer runs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import httpx

from openinfer.bench import BenchError
from openinfer.bench.client import ServerError, error_message
from openinfer.model_source import resolve_model
from openinfer.tokenizer import load_tokenizer

Conversation = list[dict[str, Any]]
"""Chat messages: ``[{"role": ..., "content": ...}, ...]``."""


@runtime_checkable
class BenchTokenizer(Protocol):
    """What workloads and the runner ask of a tokenizer. Every method keeps the input order
    and returns one answer per input."""

    name: str
    """For the record: a path, a hub name, or the server that tokenizes."""

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, with no special tokens added."""
        ...

    def decode(self, token_lists: Sequence[list[int]]) -> list[str]:
        """The text of each token-id list."""
        ...

    def render_chat(self, conversations: Sequence[Conversation],
                    add_generation_prompt: bool) -> list[list[int]]:
        """Token ids of each conversation rendered with the chat template."""
        ...


class LocalTokenizer:
    """A Hugging Face tokenizer in this process."""

    def __init__(self, hf_tokenizer: Any, name: str | None = None) -> None:
        self.hf = hf_tokenizer
        self.name = name or getattr(hf_tokenizer, "name_or_path", "") or type(hf_tokenizer).__name__

    @classmethod
    def load(cls, name: str) -> LocalTokenizer:
        """The tokenizer of a model openinfer can serve (a checkpoint, a .gguf file, a Hub id,
        a built-in name), else ``AutoTokenizer.from_pretrained(name)``; BenchError naming the
        flag if both fail."""
        from transformers import AutoTokenizer

        try:
            try:
                return cls(load_tokenizer(resolve_model(name).path), name)
            except ValueError:  # e.g. a tokenizer-only directory
                return cls(AutoTokenizer.from_pretrained(name), name)
        except Exception as e:  # not a tokenizer path or hub name
            raise BenchError(f"cannot load a tokenizer from {name!r} ({type(e).__name__}: {e}); "
                             "pass --tokenizer PATH, or leave it out to use the server's") from e

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.hf.encode(t, add_special_tokens=False) for t in texts]

    def decode(self, token_lists: Sequence[list[int]]) -> list[str]:
        return [self.hf.decode(ids) for ids in token_lists]

    def render_chat(self, conversations: Sequence[Conversation],
                    add_generation_prompt: bool) -> list[list[int]]:
        # Render to text, then encode without adding special tokens: what openinfer's and
        # vLLM's servers do with a chat request.
        return self.encode([self.hf.apply_chat_template(list(c), tokenize=False,
                                                        add_generation_prompt=add_generation_prompt)
                            for c in conversations])


class ServerTokenizer:
    """The served model's tokenizer through ``/tokenize`` and ``/detokenize``.

    Requests for one batch run ``concurrency`` at a time; equal requests are sent once and their
    answers kept for the life of the object (so rebuilding a workload costs nothing).
    ``requests`` counts the round trips made. Failures raise :class:`ServerError` that says what
    to do (a server without ``/tokenize`` answers 404: pass ``--tokenizer``). ``transport``:
    httpx's, for tests (``httpx.MockTransport``)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout_s: float = 60.0, concurrency: int = 16,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = f"{self.base_url}/tokenize"
        self.requests = 0
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers,
                                  limits=httpx.Limits(max_connections=concurrency),
                                  transport=transport)
        self._pool = ThreadPoolExecutor(max_workers=concurrency,
                                        thread_name_prefix="bench-tokenize")
        self._cache: dict[str, Any] = {}

    def __enter__(self) -> ServerTokenizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return self._batch("/tokenize", "tokens", [
            {"model": self.model, "prompt": t, "add_special_tokens": False} for t in texts])

    def decode(self, token_lists: Sequence[list[int]]) -> list[str]:
        return self._batch("/detokenize", "prompt", [
            {"model": self.model, "tokens": list(ids)} for ids in token_lists])

    def render_chat(self, conversations: Sequence[Conversation],
                    add_generation_prompt: bool) -> list[list[int]]:
        return self._batch("/tokenize", "tokens", [
            {"model": self.model, "messages": list(c), "add_generation_prompt": add_generation_prompt,
             "add_special_tokens": False} for c in conversations])

    def _batch(self, path: str, field: str, bodies: list[dict]) -> list:
        keys = [path + json.dumps(b, sort_keys=True) for b in bodies]
        todo = {k: b for k, b in zip(keys, bodies) if k not in self._cache}
        for key, answer in zip(todo, self._pool.map(lambda b: self._post(path, field, b),
                                                     todo.values())):
            self._cache[key] = answer
        return [self._cache[k] for k in keys]

    def _post(self, path: str, field: str, body: dict) -> Any:
        url = self.base_url + path
        self.requests += 1  # an int += under the GIL; the count is for reports and tests
        try:
            response = self._http.post(url, json=body)
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {url} ({type(e).__name__}: {e})") from e
        if response.status_code in (404, 405):
            raise ServerError(f"{url}: HTTP {response.status_code}; this server has no {path} "
                              "endpoint (vLLM and openinfer serve one): pass --tokenizer PATH")
        if response.status_code != 200:
            raise ServerError(f"{url}: HTTP {response.status_code}: {error_message(response.text)}")
        try:
            return response.json()[field]
        except (ValueError, KeyError, TypeError) as e:
            raise ServerError(f"{url}: the answer has no {field!r}: {response.text[:200]}") from e


def as_bench_tokenizer(tokenizer: Any) -> BenchTokenizer:
    """A :class:`BenchTokenizer` as is; anything else is taken for a Hugging Face tokenizer."""
    return tokenizer if isinstance(tokenizer, BenchTokenizer) else LocalTokenizer(tokenizer)
