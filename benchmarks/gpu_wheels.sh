#!/usr/bin/env bash
# The Python packages openinfer needs that the lent GPU machines' image lacks (it has torch,
# triton, transformers, numpy, msgpack, jinja2, httpx, uvloop, prometheus-client, pytest;
# ../.library/device/KINDS.md), as CPython 3.12 manylinux wheels in .whl/ (git-ignored), at the
# versions this checkout's venv holds. Run here (it needs PyPI); then a device call carries
# .whl and starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
PY=${PYTHON:-.venv/bin/python}
for name in pyzmq llguidance gguf fastapi starlette pydantic pydantic_core annotated-types \
        typing-inspection uvicorn httptools h11 pytest-timeout; do
    version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] || { echo "gpu_wheels: $name is not installed in $PY"; exit 1; }
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
        -d .whl "$name==$version"
done
du -sh .whl
