"""Serving benchmark: `openinfer bench serve` against any OpenAI-compatible endpoint."""


class BenchError(Exception):
    """A benchmark that cannot run as asked (bad options, an unusable server or file); the
    message says what to change. `openinfer bench` prints it and exits with status 2."""
