"""Writes one benchmark's section of docs/benchmarks.md, keeping every other section.

Every section is stamped with where its figures come from: the script, the commit (with
``+dirty`` when tracked files outside docs/ had changes), the CPU model and ISA, the core count and the date,
because these machines change from day to day and a figure without them cannot be compared.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def provenance() -> str:
    """One line: script, commit, CPU model, ISA, cores, date."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"):
        commit += "+dirty"  # code differs from the commit (edits under docs/ do not count)
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from openinfer.cpu_features import cpu_capability

        isa = cpu_capability()
    except Exception:  # a benchmark without torch still gets its stamp
        isa = "unknown ISA"
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "?"
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (f"_Measured by `benchmarks/{script}` at commit `{commit}` on {model} ({isa}, "
            f"{os.cpu_count()} cores), {when}._")


def write_section(path: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- name:start -->`` and ``<!-- name:end -->`` in path
    (appending the section if absent, creating the file if missing), stamped with its
    provenance."""
    start_marker, end_marker = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = f"{start_marker}\n{body.rstrip()}\n\n{provenance()}\n{end_marker}"
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
