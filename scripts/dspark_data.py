"""Training text for a DSpark drafter of the built-in SmolLM2, from what is installed.

No corpus is downloaded: the prompts are built from the long descriptions of the installed
Python distributions (their READMEs) and the docstrings of the standard library, and the
target answers them itself (greedy, as the drafter will be used): the drafter learns to
predict the target's own continuations (self-distillation). The repository's own sources
and docs, which ``benchmarks/bench_spec_decode.py`` copies, are not used.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import random
import re
import sys

TASKS = (
    "Summarize the following text in a few sentences.\n\n{}",
    "Explain the following text to a beginner.\n\n{}",
    "Fix any typos in the following text and return the corrected text.\n\n{}",
    "Rewrite the following text so that it is clearer.\n\n{}",
    "Write three questions a reader might ask about this text, with short answers.\n\n{}",
    "{}\n\nWhat is this text about?",
    "Continue the following text.\n\n{}",
    "List the main points of the following text.\n\n{}",
)


def _clean(text: str) -> str:
    text = re.sub(r"<[^>]+>", " ", text)  # HTML in READMEs
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", text)  # images
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text
    text = re.sub(r"[ \t]+", " ", text)
    return text.strip()


def paragraphs(min_chars: int = 200, max_chars: int = 1200) -> list[str]:
    """Paragraph runs of the installed distributions' descriptions and the standard
    library's module docstrings, each between ``min_chars`` and ``max_chars``."""
    texts = []
    for dist in importlib.metadata.distributions():
        meta = dist.metadata
        body = meta.get_payload() or meta.get("Description") or ""
        texts.append(body)
    for name in sorted(getattr(sys, "stdlib_module_names", ())):
        if name.startswith("_") or name in ("antigravity", "this", "idlelib", "tkinter", "turtle"):
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 (platform modules that do not import here)
            continue
        texts.append(module.__doc__ or "")
    out = []
    for text in texts:
        run = ""
        for block in re.split(r"\n\s*\n", text):
            block = _clean(block)
            if not block or block.startswith(("```", "..", "|", "+-", "==")):
                continue
            run = f"{run}\n\n{block}" if run else block
            if len(run) >= min_chars:
                if len(run) <= max_chars:
                    out.append(run)
                run = ""
    return sorted(set(out))


def chat_prompts(seed: int = 0) -> list[str]:
    """Every paragraph once, with a task drawn for it."""
    rng = random.Random(seed)
    texts = paragraphs()
    rng.shuffle(texts)
    return [rng.choice(TASKS).format(text) for text in texts]
