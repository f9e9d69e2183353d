#!/usr/bin/env bash
# The Triton attention backend and decode CUDA graphs on a CUDA machine, in one command
# (about 2-5 minutes):
#   (a) the parity tests (tests/kernels/test_triton_attention.py, and the MoE experts'
#       tests/kernels/test_triton_moe.py) compiled for the GPU, against the torch reference
#       (no TRITON_INTERPRET), and decode through captured CUDA graphs against eager decode,
#       token for token, dense and MoE (tests/kernels/test_decode_graphs.py);
#   (b) timings of the Triton and torch backends at Qwen3-0.6B-like shapes, as a markdown table
#       with the GPU, the commit and the torch/triton versions (benchmarks/gpu_check.py);
#   (c) decode tokens/s with CUDA graphs (and graphs + async scheduling) against eager,
#       Qwen3-0.6B shape, batches 1, 8 and 32
#       (benchmarks/bench_decode_graphs.py).
# Exits non-zero if a parity test or a timed shape's parity fails (every part runs regardless).
# Needs the repo's venv (`make install`) or, on a lent GPU machine, the wheels below. On a machine without CUDA it says so, runs the tests and a tiny smoke run
# through Triton's interpreter instead (a check of this script), and exits 0 unless they fail.
#
#   benchmarks/gpu_check.sh            # PYTHON=... to use another interpreter
#
# On a lent GPU machine: run benchmarks/gpu_wheels.sh here first, then one device call with
# carry [".whl"] and the command `bash benchmarks/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ -z "${PYTHON:-}" ] && [ ! -x .venv/bin/python ] && [ -d .whl ]; then
    # A lent GPU machine (the `device` tool, carrying .whl from benchmarks/gpu_wheels.sh): its
    # image's python3 has torch and triton; openinfer's other packages travel as wheels.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
    PY=python3
fi
export OPENINFER_COMMIT=${OPENINFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
status=0

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "== (a) Triton parity tests on $("$PY" -c 'import torch; print(torch.cuda.get_device_name())')"
    env -u TRITON_INTERPRET "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
        tests/kernels/test_triton_moe.py tests/kernels/test_decode_graphs.py || status=1
    echo "== (b) Triton vs torch reference timings"
    env -u TRITON_INTERPRET "$PY" benchmarks/gpu_check.py || status=1
    echo "== (c) decode: CUDA graphs vs eager"
    env -u TRITON_INTERPRET "$PY" benchmarks/bench_decode_graphs.py || status=1
else
    echo "gpu_check: no CUDA device here: SKIPPING the CUDA parity tests and timings;"
    echo "gpu_check: running the same tests and a tiny smoke run in Triton's CPU interpreter instead"
    TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
        tests/kernels/test_triton_moe.py tests/kernels/test_decode_graphs.py || status=1
    TRITON_INTERPRET=1 "$PY" benchmarks/gpu_check.py --quick || status=1
fi

if [ "$status" -ne 0 ]; then
    echo "gpu_check: FAILED (see above)"
else
    echo "gpu_check: OK"
fi
exit "$status"
