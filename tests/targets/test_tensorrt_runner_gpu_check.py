"""scripts/gpu_check.sh and scripts/bench_tensorrt.py on CPU: the script is shellcheck-clean, the report it
writes where nothing can run (this machine: no TensorRT, no GPU) matches the documented JSON Schema, and
docs/tensorrt-runtime.md names every key of that schema. The benchmark itself runs only on a GPU host."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "docs" / "tensorrt-runtime.schema.json"


def _keys(schema: dict) -> set[str]:
    keys = set(schema.get("properties", {}))
    for sub in [*schema.get("properties", {}).values(), schema.get("items", {}), *schema.get("oneOf", [])]:
        if isinstance(sub, dict) and sub:
            keys |= _keys(sub)
    return keys


def test_gpu_check_is_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    done = subprocess.run([shellcheck, str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_every_report_key_is_documented():
    docs = (REPO / "docs" / "tensorrt-runtime.md").read_text()
    undocumented = sorted(k for k in _keys(json.loads(SCHEMA.read_text())) if f"`{k}`" not in docs)
    assert not undocumented, f"docs/tensorrt-runtime.md does not explain {undocumented}"


def test_report_without_a_gpu_matches_the_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    log = tmp_path / "test-gpu.log"
    log.write_text("make test-gpu: this host cannot run the gpu suite: no TensorRT\nmake: *** Error 1\n")
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_tensorrt.py"), "--work", str(tmp_path / "w"),
                           "--out", str(out), "--test-gpu-rc", "2", "--test-gpu-log", str(log),
                           "--junit", str(tmp_path / "absent.xml")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # the suite did not pass and nothing was benchmarked
    report = json.loads(out.read_text())
    jsonschema.validate(report, json.loads(SCHEMA.read_text()))
    assert report["benchmarks"] == [] and report["benchmark_skipped"]
    assert report["test_gpu"]["stopped_with"] == "make test-gpu: this host cannot run the gpu suite: no TensorRT"


def test_host_check_fails_without_cuda_torch_and_says_why(tmp_path, capsys, monkeypatch):
    """#27 item 8: `make test-gpu` stops (exit 1) where torch has no CUDA, naming it; with CUDA but no TensorRT it
    selects the CUDA-only gpu tests. This machine's torch is a CPU build."""
    from trt_diffusion.targets.tensorrt import host_check

    status = tmp_path / "gpu_host.json"
    assert host_check.main(["--mode", "--json", str(status)]) == 1
    assert "CPU build (no CUDA)" in capsys.readouterr().err
    assert json.loads(status.read_text())["mode"] == "none"
    monkeypatch.setattr(host_check, "torch_cuda_reason", lambda: None)  # a CUDA host without TensorRT
    assert host_check.main(["--mode"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "cuda-only" and "TensorRT is missing" in captured.err


def test_make_test_gpu_runs_the_cuda_only_tests_without_tensorrt_and_then_fails():
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("test-gpu: $(GPU_VENV)/.installed"):]
    assert '-m "gpu and not tensorrt"' in recipe and "exit 1" in recipe and "--system-site-packages" in makefile
