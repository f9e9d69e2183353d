"""Serving benchmark: `openinfer bench serve` against any OpenAI-compatible endpoint."""
