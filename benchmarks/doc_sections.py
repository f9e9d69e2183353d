"""Writes one benchmark's section of docs/benchmarks.md, keeping every other section."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- name:start -->`` and ``<!-- name:end -->`` in path
    (appending the section if absent, creating the file if missing)."""
    start_marker, end_marker = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = f"{start_marker}\n{body}\n{end_marker}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# Benchmarks\n\n{section}\n")
        return
    text = path.read_text()
    start, end = text.find(start_marker), text.find(end_marker)
    if start != -1 and end > start:
        text = text[:start] + section + text[end + len(end_marker):]
    else:
        text = text.rstrip("\n") + f"\n\n{section}\n"
    path.write_text(text)
