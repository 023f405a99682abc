"""#27 item 5: Triton serves version-compatible plans only with `--backend-config=tensorrt,version-compatible=true`;
the server command line carries it exactly when a packaged plan needs it. CPU only (the command is built, not run)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

import trt_diffusion.targets.tensorrt as trt_target
from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
from trt_diffusion.targets.base import BuiltEngine
from trt_diffusion.targets.tensorrt.build_flags import BuildFlags
from trt_diffusion.targets.tensorrt.manifest import EngineManifest, engine_path, manifest_path
from trt_diffusion.targets.tensorrt.triton_args import VERSION_COMPATIBLE_ARG, version_compatible_models
from trt_diffusion.tensors import TensorSpec
from trt_diffusion.triton.server import TritonServer


def _spec(component: str, version_compatible: bool) -> EngineSpec:
    options = (("tensorrt_version_compatible", True),) if version_compatible else ()
    return EngineSpec(model="m", family="sd15", source="s", component=component, target="tensorrt",
                      precision="fp32", batch=1, bucket=Bucket.static(Size(64, 64)), build_options=options)


def _package(workspace: Path, repo: Path, spec: EngineSpec) -> None:
    """A built plan, laid into the repository as `triton_model` names its files (what `package` copies)."""
    plan = engine_path(workspace, spec)
    plan.parent.mkdir(parents=True, exist_ok=True)
    plan.write_bytes(b"plan-" + spec.component.encode())
    manifest = EngineManifest(
        spec_key=spec.key, spec_name=spec.name, tensorrt_version="10.13.0.35", compute_capability=(9, 0),
        device_name="NVIDIA H200", flags=BuildFlags.for_spec(spec, False).to_dict(), profile_shapes={},
        onnx_sha256="0" * 64, inputs=(TensorSpec(name="x", dtype="float32", shape=(1,)),), outputs=(),
        plan_bytes=plan.stat().st_size, plan_sha256=hashlib.sha256(plan.read_bytes()).hexdigest(), build_seconds=0)
    manifest.write(manifest_path(plan))
    model = trt_target.TensorRTTarget().triton_model(BuiltEngine(spec, plan, manifest), engine_backend="tensorrt")
    version = repo / spec.component / "1"
    version.mkdir(parents=True)
    for name, source in model.files.items():
        shutil.copy(source, version / name)


def _command(repo: Path, tmp_path: Path, monkeypatch) -> list[str]:
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: "/opt/tritonserver/bin/tritonserver")
    return TritonServer(repo, tmp_path / "work").command()[0]


def test_the_server_gets_the_version_compatible_backend_config_when_a_plan_needs_it(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    _package(tmp_path / "ws", repo, _spec("text_encoder", version_compatible=False))
    assert VERSION_COMPATIBLE_ARG not in _command(repo, tmp_path, monkeypatch)
    _package(tmp_path / "ws", repo, _spec("unet", version_compatible=True))
    assert version_compatible_models(repo) == ["unet"]
    command = _command(repo, tmp_path, monkeypatch)
    assert command.count(VERSION_COMPATIBLE_ARG) == 1
    assert command.index(VERSION_COMPATIBLE_ARG) > command.index(f"--model-repository={repo}")


@pytest.mark.parametrize("manifest", ['{"target": "onnxruntime", "flags": {"version_compatible": true}}', "not json"])
def test_other_manifests_ask_for_nothing(tmp_path, manifest):
    version = tmp_path / "repo" / "vae" / "1"
    version.mkdir(parents=True)
    (version / "model.plan").write_bytes(b"x")
    (version / "manifest.json").write_text(manifest)
    assert version_compatible_models(tmp_path / "repo") == []
