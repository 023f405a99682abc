"""A no-op build answers from the saved build state without importing torch, and any change to what the
engines were made from, or to the engines themselves, sends it back to the full check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml

from trt_diffusion import api
from trt_diffusion.engine_builds import build_state

HEAVY = ("torch", "diffusers", "transformers", "onnx", "onnxruntime")


def _imports_after(argv: list[str]) -> tuple[int, set[str]]:
    """Run the CLI in a fresh interpreter and return (exit code, heavy modules it imported)."""
    script = textwrap.dedent(f"""
        import sys
        from trt_diffusion.cli import main
        code = main({argv!r})
        print("HEAVY=" + ",".join(m for m in {HEAVY!r} if m in sys.modules))
        sys.exit(code)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    line = next(line for line in result.stdout.splitlines() if line.startswith("HEAVY="))
    return result.returncode, set(filter(None, line.removeprefix("HEAVY=").split(",")))


def test_plan_and_a_no_op_build_import_no_torch_diffusers_or_onnx(built_sd15):
    code, heavy = _imports_after(["plan", str(built_sd15)])
    assert code == 0 and heavy == set()
    # Other tests build parts of this shared workspace (a target, a shard), each recording its own state:
    # a complete build first makes the next one the no-op under test.
    assert not api.build(built_sd15).failed
    code, heavy = _imports_after(["build", str(built_sd15)])
    assert code == 0 and heavy == set()


@pytest.fixture
def private_build(tmp_path, built_sd15, tiny_sd15_dir):
    """A copy of the built workspace and of the model it was built from, so files can be touched."""
    model = shutil.copytree(tiny_sd15_dir, tmp_path / "model")
    shutil.copytree(built_sd15.parent / "build", tmp_path / "build")
    data = yaml.safe_load(built_sd15.read_text())
    data["build"]["workspace"] = str(tmp_path / "build")
    entry = data["models"]["sd15-tiny"]
    entry["source"] = str(model)
    entry["controlnets"]["canny"]["source"] = str(model / "controlnet")
    entry["loras"]["style"]["source"] = str(model / "lora/pytorch_lora_weights.safetensors")
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(data))
    report = api.build(path)  # the full check (the model's new path gives new keys): builds, saves the state
    assert not report.failed and len(report.outcomes) == 4
    return path, model


def _full_check_calls(monkeypatch) -> list:
    calls = []
    real = api.engine_sources  # the full check starts by exporting (cached) what the engines are built from

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "engine_sources", counting)
    return calls


def test_unchanged_inputs_skip_the_full_check(private_build, monkeypatch):
    path, _ = private_build
    calls = _full_check_calls(monkeypatch)
    report = api.build(path)
    assert calls == [] and len(report.cached) == len(report.outcomes) == 4


def test_a_touched_weight_file_runs_the_full_check(private_build, monkeypatch):
    path, model = private_build
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    calls = _full_check_calls(monkeypatch)
    report = api.build(path)
    assert len(calls) == 1 and not report.failed  # same bytes: the manifests still trust every engine
    assert len(report.cached) == 4


def test_an_edited_engine_runs_the_full_check_and_is_rebuilt(private_build, monkeypatch):
    path, _ = private_build
    report = api.build(path)
    unet = next(o for o in report.outcomes if o.spec.component == "unet")
    with open(unet.path / "model.onnx", "ab") as handle:
        handle.write(b"\0")
    calls = _full_check_calls(monkeypatch)
    report = api.build(path)
    assert len(calls) == 1 and [o.spec.component for o in report.built] == ["unet"]


def test_a_failed_build_leaves_no_state(private_build, monkeypatch):
    path, _ = private_build
    config = api.load_engines_file(path)
    state = config.workspace / build_state.STATE_FILE
    assert state.is_file()
    from trt_diffusion.engine_builds.report import BuildReport, EngineOutcome, Failure

    spec = api.plan(path, count_parameters=False).specs[0]
    build_state.record(config, BuildReport([EngineOutcome(spec, None, failure=Failure(spec.name, spec.key, "x"))]))
    assert not state.exists()
