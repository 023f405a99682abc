#!/usr/bin/env bash
# One command for a GPU host with the project installed (make venv): the gpu suite (make test-gpu, which
# installs .[tensorrt,test] from NVIDIA's index) and the TensorRT benchmark (scripts/bench_tensorrt.py:
# TensorRT vs PyTorch fp16, full-size SD1.5 and SDXL UNets at 512x512 and 1024x1024, random weights, no
# download), into one JSON. docs/tensorrt-runtime.md documents the JSON.
#
#   scripts/gpu_check.sh [OUT.json]          default: build/gpu_check.json
#   GPU_CHECK_RUNS=50 GPU_CHECK_ARGS="--family sd15" scripts/gpu_check.sh
#
# Exit status: 0 when the suite passed and every benchmark ran, 1 otherwise; the JSON is written either way.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-build/gpu_check.json}"
work="${GPU_CHECK_WORK:-build/gpu_check}"
python="${PYTHON_BIN:-$( [ -x .venv-gpu/bin/python ] && echo .venv-gpu/bin/python || echo .venv/bin/python )}"  # make test-gpu makes .venv-gpu
runs="${GPU_CHECK_RUNS:-20}"
read -r -a extra <<< "${GPU_CHECK_ARGS:-}"

mkdir -p "$work" "$(dirname "$out")"
rm -f "$work/junit.xml"

echo "gpu_check: make test-gpu (log: $work/test-gpu.log)"
test_rc=0
make test-gpu PYTEST_ARGS="--junitxml=$work/junit.xml" > "$work/test-gpu.log" 2>&1 || test_rc=$?
tail -n 3 "$work/test-gpu.log"

echo "gpu_check: benchmark (work folder: $work)"
bench_rc=0
"$python" scripts/bench_tensorrt.py --work "$work" --out "$out" --runs "$runs" \
    --test-gpu-rc "$test_rc" --test-gpu-log "$work/test-gpu.log" --junit "$work/junit.xml" \
    "${extra[@]}" || bench_rc=$?

echo "gpu_check: $out (test-gpu exit $test_rc, benchmark exit $bench_rc)"
if [ "$test_rc" -ne 0 ] || [ "$bench_rc" -ne 0 ]; then
    exit 1
fi
