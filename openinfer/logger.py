"""openinfer's log lines: ``INFO 12-01 06:40:01 [engine.core] KV cache: ...`` on stderr.

Configured once per process for the ``openinfer`` logger only (other libraries keep their
own settings), at import of the package as vLLM does; ``OPENINFER_CONFIGURE_LOGGING=0``
leaves logging to the application. The level comes from ``OPENINFER_LOGGING_LEVEL``
(default INFO), which child processes (the engine core, replicas) inherit.
"""

from __future__ import annotations

import logging
import os
import sys
import time

LEVEL_ENV = "OPENINFER_LOGGING_LEVEL"
_FORMAT = "%(levelname)s %(asctime)s [%(short_name)s] %(message)s"


class _ShortNames(logging.Filter):
    """``openinfer.engine.core`` -> ``engine.core``: the package name says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.short_name = record.name.removeprefix("openinfer.")
        return True


def configure_logging(level: str | None = None) -> None:
    """Send the ``openinfer`` logger's records of ``level`` and up to stderr (idempotent).
    A given level is exported to the environment, so processes started later share it."""
    if level is not None:
        os.environ[LEVEL_ENV] = level.upper()
    if os.environ.get("OPENINFER_CONFIGURE_LOGGING", "1") == "0":
        return
    root = logging.getLogger("openinfer")
    root.setLevel(os.environ.get(LEVEL_ENV, "INFO").upper())
    if not any(getattr(h, "_openinfer", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        handler.addFilter(_ShortNames())
        handler._openinfer = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False


class PeriodicStats:
    """Logs the engine's throughput and queue every ``interval_s`` while it is busy."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._last_prompt_total = 0
        self._seen_prompt_total = 0

    def record(self, num_generated: int, stats: dict) -> None:
        """After each step: ``num_generated`` new tokens; ``stats`` is EngineCore.stats()."""
        self._generated_tokens += num_generated
        prompt_total = self._seen_prompt_total = stats.get("prompt_tokens_computed", 0)
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return
        prompt_tokens = prompt_total - self._last_prompt_total
        queries = stats.get("prefix_cache_queries", 0)
        hit_rate = stats.get("prefix_cache_hits", 0) / queries if queries else 0.0
        logging.getLogger("openinfer.engine").info(
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
            "running: %d, waiting: %d, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
            prompt_tokens / elapsed, self._generated_tokens / elapsed,
            stats.get("num_running", 0), stats.get("num_waiting", 0),
            100 * stats.get("kv_cache_usage", 0.0), 100 * hit_rate)
        self._last_time, self._last_prompt_total = now, prompt_total
        self._generated_tokens = 0

    def idle(self) -> None:
        """An idle engine has nothing to report: the next busy window starts now."""
        self._last_time = time.monotonic()
        self._generated_tokens = 0
        self._last_prompt_total = self._seen_prompt_total
