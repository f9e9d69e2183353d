"""The router's place in the import order: it reads requests with the server's protocol
and prompt modules only, so it starts without the engine or torch (the whole package's
order and cycles: tests/test_layers.py)."""

from __future__ import annotations

import subprocess
import sys


def test_router_imports_neither_the_engine_nor_torch():
    probe = ("import sys, openinfer.router.app\n"
             "bad = sorted(m for m in sys.modules if m.startswith('openinfer.engine') or m in "
             "('torch', 'openinfer.server.anthropic_api', 'openinfer.server.app'))\n"
             "print(' '.join(bad))")
    # A fresh interpreter: this one has long since imported the engine for other tests.
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == []
