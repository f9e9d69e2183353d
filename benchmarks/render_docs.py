"""Render docs/benchmarks.md from the result files in benchmarks/results/.

    python benchmarks/render_docs.py          # rewrite the page's sections and index
    python benchmarks/render_docs.py --check  # exit 1 if the page is not what the files give

Each benchmark script saves its result file and renders the page itself
(``doc_sections.write_section``); this is for a result file edited or added by hand. The page's
hand-kept text (its header, the notes after a section) is left as it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from doc_sections import PAGE, RESULTS, load_results, render, render_text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the page is up to date")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.check:
        text = args.page.read_text()
        if render_text(text, load_results(args.results)) != text:
            print(f"{args.page} differs from {args.results}: run benchmarks/render_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    print("rendered" if render(args.page, args.results) else "unchanged", args.page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
