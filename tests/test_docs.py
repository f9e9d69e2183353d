"""The documentation: README.md stays a short front page that opens with the two-command
quick start, its links resolve, and the docs/ site builds with ``mkdocs build --strict``
(a broken link or anchor, or a page missing from mkdocs.yml's nav, fails it)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
QUICK_START = """```bash
make serve   # installs into .venv and serves SmolLM2-135M-Instruct on localhost:8000
make test    # installs into .venv and runs the test suite
```"""


def test_readme_is_a_short_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 160, "README.md is the front page: move reference prose to docs/"
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings[0] == "Quick start"
    first_block = text[text.index("```"):]
    assert first_block.startswith(QUICK_START), "the quick start is exactly `make serve` and `make test`"


def test_readme_links_resolve():
    text = README.read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        if target.startswith("#"):
            assert target[1:] in anchors, f"README.md links to a missing heading {target}"
            continue
        path = target.split("#", 1)[0]
        assert (REPO / path).exists(), f"README.md links to a missing file {target}"


def test_docs_site_builds_strict(tmp_path):
    # A subprocess: mkdocs' plugins and markdown extensions stay out of the test process.
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "index.html").exists()
    for page in (REPO / "docs").glob("*.md"):
        assert (tmp_path / page.stem / "index.html").exists() or page.stem == "index", page.name


def _doc_sections():
    spec = importlib.util.spec_from_file_location("doc_sections", REPO / "benchmarks" / "doc_sections.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_page_is_rendered_from_the_result_files():
    ds = _doc_sections()
    text = ds.PAGE.read_text()
    assert ds.render_text(text, ds.load_results()) == text, \
        "docs/benchmarks.md differs from benchmarks/results/: run benchmarks/render_docs.py"


def test_write_section_saves_a_result_file_and_renders_the_page(tmp_path, monkeypatch):
    ds = _doc_sections()
    page, results = tmp_path / "benchmarks.md", tmp_path / "results"
    monkeypatch.setattr(ds, "PAGE", page)
    monkeypatch.setattr(ds, "RESULTS", results)
    page.write_text("# Benchmarks\n\nHand-kept header.\n\n<!-- index:start -->\n<!-- index:end -->\n\n"
                    "<!-- a:start -->\nold\n<!-- a:end -->\n\nA note read by hand.\n")
    ds.write_section(page, "a", "## A (`benchmarks/a.py`)\n\n| x |\n|---|\n| 1 |")
    ds.write_section(str(page), "b", "## B\n\nnew section")
    result = json.loads((results / "a.json").read_text())
    assert result["body"].startswith("## A")
    assert {"script", "commit", "cpu", "isa", "cores", "date"} <= set(result)
    text = page.read_text()
    assert "old" not in text and "Hand-kept header." in text and "A note read by hand." in text
    assert text.index("<!-- a:end -->") < text.index("A note read by hand.") < text.index("<!-- b:start -->")
    assert ds.stamp(result) in text
    assert "| [A](#a-benchmarksapy) |" in text and "| [B](#b) |" in text
    assert ds.render_text(text, ds.load_results(results)) == text
