"""openinfer turns on torch's huge-page allocations at import, unless the user said otherwise."""

import os
import subprocess
import sys

import pytest

from openinfer.huge_pages import system_mode

PROBE = "import openinfer; from openinfer.huge_pages import huge_pages_in_use as f; print(f())"


def probe(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


@pytest.mark.skipif(system_mode() != "madvise", reason="needs the kernel's THP madvise mode")
def test_import_requests_huge_pages_and_the_user_can_refuse():
    assert probe(None) == "True"
    assert probe("0") == "False"
