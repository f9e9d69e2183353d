"""Benchmark results and the page that shows them, docs/benchmarks.md.

A benchmark script calls ``write_section(path, name, body)`` with its Markdown section. For
docs/benchmarks.md that saves a result file, ``benchmarks/results/<name>.json`` (the section's
body and where its figures come from: script, commit, CPU model, ISA, cores, date), then
renders the page from every result file (``render``; ``benchmarks/render_docs.py`` does the
same by hand). Rendering replaces the text between ``<!-- name:start -->`` and
``<!-- name:end -->`` for each result, appends a section the page lacks, and rebuilds the
index between ``<!-- index:start -->`` and ``<!-- index:end -->``: one row per section with
its script, date, commit and CPU. Everything else on the page (its header, the notes that read
a section's figures) is hand-kept text that rendering leaves alone.

Every figure is stamped with where it comes from (the commit with ``+dirty`` when tracked files
outside docs/ and benchmarks/results/ had changes), because these machines change from day to
day and a figure without its CPU and date cannot be compared. Other pages
(docs/reliability.md) get their sections written in place, stamped the same way.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "benchmarks" / "results"
INDEX = "index"
"""The marker name of the page's index of sections."""


def provenance_fields() -> dict:
    """Where figures measured now come from: script, commit, CPU model, ISA, cores, date."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs", ":!benchmarks/results"):
        commit += "+dirty"  # code differs from the commit (docs/ and result files do not count)
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
    return {"script": script, "commit": commit, "cpu": model, "isa": isa, "cores": os.cpu_count(),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def stamp(fields: dict) -> str:
    """The section's last line: ``_Measured by `benchmarks/S` at commit `C` on CPU (ISA, N
    cores), DATE._`` (a ``note`` field follows the commit)."""
    note = f" {fields['note']}" if fields.get("note") else ""
    return (f"_Measured by `benchmarks/{fields['script']}` at commit `{fields['commit']}`{note} on "
            f"{fields['cpu']} ({fields['isa']}, {fields['cores']} cores), {fields['date']}._")


def provenance() -> str:
    """One line: script, commit, CPU model, ISA, cores, date."""
    return stamp(provenance_fields())


def section_text(result: dict) -> str:
    """A result's section as the page shows it, without its markers."""
    body = result["body"].rstrip()
    return f"{body}\n\n{stamp(result)}" if result.get("stamped", True) else body


def save_result(name: str, body: str, results: Path = RESULTS) -> Path:
    """``results/<name>.json``: the body and the provenance of figures measured now."""
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    path.write_text(json.dumps({"name": name, **provenance_fields(), "body": body.rstrip() + "\n"},
                               indent=1, ensure_ascii=False) + "\n")
    return path


def load_results(results: Path = RESULTS) -> dict[str, dict]:
    """Every result file, by section name."""
    return {r["name"]: r for r in (json.loads(p.read_text()) for p in sorted(results.glob("*.json")))}


def replace_section(text: str, name: str, content: str) -> str:
    """text with the section ``name`` set to content (appended where it has none)."""
    start_marker, end_marker = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = f"{start_marker}\n{content.rstrip()}\n{end_marker}"
    start, end = text.find(start_marker), text.find(end_marker)
    if start != -1 and end > start:
        return text[:start] + section + text[end + len(end_marker):]
    return text.rstrip("\n") + f"\n\n{section}\n"


def slug(title: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[`*]", "", title)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def index_table(text: str, results: dict[str, dict]) -> str:
    """One row per section of text that has a result file, in page order."""
    rows = ["| section | script | measured | commit | CPU |", "|---|---|---|---|---|"]
    for name in re.findall(r"<!-- (\S+):start -->", text):
        result = results.get(name)
        if result is None:
            continue
        heading = re.search(r"^## (.+)$", result["body"], flags=re.M)
        title = heading.group(1) if heading else name
        short = re.sub(r"\s*\((`?benchmarks/|`?\.\./)[^)]*\)\s*$", "", title)
        rows.append(f"| [{short}](#{slug(title)}) | `{result['script']}` | {result['date']} | "
                    f"`{result['commit']}` | {result['cpu']} ({result['isa']}, {result['cores']} cores) |")
    return "\n".join(rows)


def render_text(text: str, results: dict[str, dict]) -> str:
    """The page text with every result's section and the index rebuilt from results."""
    for name, result in results.items():
        text = replace_section(text, name, section_text(result))
    if f"<!-- {INDEX}:start -->" in text:
        text = replace_section(text, INDEX, index_table(text, results))
    return text


def render(page: Path = PAGE, results: Path = RESULTS) -> bool:
    """Render page from the result files; True if it changed."""
    text = page.read_text()
    new = render_text(text, load_results(results))
    if new != text:
        page.write_text(new)
    return new != text


def write_section(path: Path | str, name: str, body: str) -> None:
    """Record one benchmark's section. For docs/benchmarks.md: save its result file and render
    the page. Any other path: replace the section in place (appending it if absent, creating
    the file if missing), stamped with its provenance."""
    path = Path(path)
    if path.resolve() == PAGE.resolve():
        save_result(name, body, RESULTS)
        render(PAGE, RESULTS)
        return
    content = f"{body.rstrip()}\n\n{provenance()}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# Benchmarks\n\n<!-- {name}:start -->\n{content}\n<!-- {name}:end -->\n")
        return
    path.write_text(replace_section(path.read_text(), name, content))
