"""Temporaries a SIGKILL leaves behind are cleaned (issue 20, item 13).

- Beside engines: a builder holding an engine's lock removes the temporaries of that engine (a killed build's
  `mkdtemp` folder, tensorrt's `*.tmp` files): only a holder of that lock makes them, so they are dead. Other
  engines' temporaries and other files are left alone.
- Beside the Triton repository: `package` removes staging and replaced folders of a dead owner that nobody
  touched for a while; a live owner's or a fresh one stays.
- `serve`'s temporary work folder goes when the server stops or fails to start (its signals are tested
  against the real server in tests/triton/test_serve_signals.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from trt_diffusion.engine_builds import stage
from trt_diffusion.engines_file.engine_spec import EngineSpec
from trt_diffusion.workspace.locks import lock_path

SPEC = EngineSpec(model="m", family="sd15", source="here", component="text_encoder", target="onnxruntime",
                  precision="fp32", batch=1, bucket=None)
OTHER = EngineSpec(model="m", family="sd15", source="here", component="text_encoder", target="onnxruntime",
                   precision="fp16", batch=1, bucket=None)
PROFILE = {"x": ((1, 4), (1, 4), (1, 4))}


def _config(workspace: Path) -> SimpleNamespace:
    """What build_one reads of an EnginesConfig: a folder workspace."""
    return SimpleNamespace(workspace=workspace, build=SimpleNamespace(workspace=str(workspace)))


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def _age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    for entry in [path, *path.rglob("*")]:
        os.utime(entry, (old, old), follow_symlinks=False)


# ------------------------------------------------------------------------------------------- engines


def test_a_builder_holding_the_lock_removes_its_engines_temporaries(tmp_path, monkeypatch):
    engines = tmp_path / "engines"
    prefix = f".{SPEC.name}.{SPEC.key}."
    left = [engines / "onnxruntime" / f"{prefix}k3x9_a2b", engines / "openvino" / f"{prefix}zz81qq0m",
            engines / "tensorrt" / f"{prefix}plan.ab12cd34.tmp", engines / "tensorrt" / f"{prefix}manifest.json.x.tmp"]
    kept = [engines / "onnxruntime" / f".{OTHER.name}.{OTHER.key}.k3x9_a2b",  # another engine's: maybe live
            engines / "onnxruntime" / f"{SPEC.name}.{SPEC.key}",  # the engine itself
            engines / "tensorrt" / f"{prefix}plan.pull.123.abcd1234"]  # a remote pull's file: not ours to judge
    for path in left[:2] + kept[:2]:
        path.mkdir(parents=True)
        (path / "model.onnx").write_bytes(b"half")
    for path in left[2:] + kept[2:]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
    seen = {}

    class Target:
        def build(self, request):
            seen["locked"] = lock_path(tmp_path, SPEC.key).is_file()
            seen["left"] = [p.name for p in left if p.exists()]
            return kept[1], True

    monkeypatch.setattr(stage, "get_target", lambda name: Target())
    monkeypatch.setattr(stage, "build_request", lambda config, spec, onnx: None)
    stage.build_one(_config(tmp_path), SPEC, tmp_path / "model.onnx")
    assert seen == {"locked": True, "left": []}
    assert [p for p in kept if not p.exists()] == []


def _tiny_onnx(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "tiny", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


KILLED_BUILD = textwrap.dedent('''
    import os, signal, sys
    from trt_diffusion.engines_file.engine_spec import EngineSpec
    from trt_diffusion.targets.onnxruntime.engine import build_engine

    spec = EngineSpec(model="m", family="sd15", source="here", component="text_encoder", target="onnxruntime",
                      precision="fp32", batch=1, bucket=None)
    build_engine(sys.argv[1], spec, {"x": ((1, 4), (1, 4), (1, 4))}, sys.argv[2],
                 before_commit=lambda folder: os.kill(os.getpid(), signal.SIGKILL))
''')


def test_an_onnxruntime_build_killed_before_it_publishes_leaves_nothing_after_the_next_build(tmp_path, monkeypatch):
    from trt_diffusion.targets.base import BuildRequest

    onnx_path = _tiny_onnx(tmp_path / "model.onnx")
    workspace = tmp_path / "ws"
    killed = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(onnx_path), str(workspace)])
    assert killed.returncode == -signal.SIGKILL
    folder = workspace / "engines" / "onnxruntime"
    assert [p.name for p in folder.iterdir()][0].startswith(f".{SPEC.name}.{SPEC.key}.")  # the reproduction

    request = BuildRequest(spec=SPEC, onnx_path=onnx_path, profile=PROFILE, workspace=workspace,
                           timing_cache_dir=tmp_path / "cache")
    monkeypatch.setattr(stage, "build_request", lambda config, spec, onnx: request)
    path, cached = stage.build_one(_config(workspace), SPEC, onnx_path)
    assert not cached and path.is_dir()
    assert sorted(p.name for p in folder.iterdir()) == [f"{SPEC.name}.{SPEC.key}"]


# ------------------------------------------------------------------------------------------- repository


def _staging(parent: Path, name: str, *, seconds_old: float) -> Path:
    path = parent / name
    (path / "model" / "1").mkdir(parents=True)
    (path / "model" / "config.pbtxt").write_text("name: 'model'\n")
    _age(path, seconds_old)
    return path


def test_package_removes_staging_folders_of_dead_owners(tmp_path):
    from trt_diffusion.triton.repository import STALE_STAGING_S, clean_stale_staging

    out = tmp_path / "triton_repo"
    out.mkdir()
    dead, old = _dead_pid(), STALE_STAGING_S + 60
    gone = [_staging(tmp_path, f".triton_repo.{dead}.ab_12cd3", seconds_old=old),
            _staging(tmp_path, f".triton_repo.old-{dead}-1733040000000000000", seconds_old=old),
            _staging(tmp_path, ".triton_repo.k3x9_a2b", seconds_old=old)]  # from a version without the pid
    stay = [_staging(tmp_path, f".triton_repo.{os.getppid()}.ab_12cd3", seconds_old=old),  # a live owner
            _staging(tmp_path, f".triton_repo.{dead}.zz81qq0m", seconds_old=30),  # recent: maybe another host's
            _staging(tmp_path, f".triton_repo.x.{dead}.ab_12cd3", seconds_old=old),  # repository "triton_repo.x"
            _staging(tmp_path, f".other.{dead}.ab_12cd3", seconds_old=old)]
    assert sorted(clean_stale_staging(out)) == sorted(gone)
    assert [p for p in gone if p.exists()] == []
    assert [p for p in stay if not p.exists()] == []
    assert out.is_dir()


def test_a_recently_written_entry_keeps_its_staging_folder(tmp_path):
    from trt_diffusion.triton.repository import STALE_STAGING_S, clean_stale_staging

    folder = _staging(tmp_path, f".repo.{_dead_pid()}.ab_12cd3", seconds_old=STALE_STAGING_S + 60)
    os.utime(folder / "model")  # a model folder just written: the packager is at work
    assert clean_stale_staging(tmp_path / "repo") == []


def test_package_cleans_before_it_stages(tmp_path, monkeypatch):
    """The cleaner runs inside `package` (stopped at the first thing it does after)."""
    from trt_diffusion.triton import repository

    folder = _staging(tmp_path, f".repo.{_dead_pid()}.ab_12cd3", seconds_old=repository.STALE_STAGING_S + 60)

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    from unittest import mock

    for name in ("_single_target", "_check_components", "_check_unique", "_sizes", "_pipeline_plans"):
        monkeypatch.setattr(repository, name, lambda *a, **k: [])
    monkeypatch.setattr(repository, "_description", lambda *a, **k: mock.MagicMock())
    monkeypatch.setattr(repository, "PackageReport", lambda **kwargs: None)
    monkeypatch.setattr(repository.tempfile, "mkdtemp", stop)
    with pytest.raises(Stop):
        repository.package([], tmp_path, "sd15", "tiny", tmp_path / "repo")
    assert not folder.exists()


# ------------------------------------------------------------------------------------------- serve


def test_serve_removes_its_work_folder_when_the_server_fails_to_start(tmp_path, monkeypatch):
    from trt_diffusion.errors import ServeError
    from trt_diffusion.triton import stage as serve_stage

    made = []
    real_mkdtemp = serve_stage.tempfile.mkdtemp

    def mkdtemp(**kwargs):
        made.append(Path(real_mkdtemp(dir=tmp_path, **kwargs)))
        return str(made[-1])

    def fail(*args, **kwargs):
        raise ServeError("tritonserver exited")

    monkeypatch.setattr(serve_stage.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(serve_stage, "PackageReport", SimpleNamespace(read=lambda repo: None))
    monkeypatch.setattr(serve_stage, "validate_repository", lambda repo: None)
    monkeypatch.setattr(serve_stage, "start_server", fail)
    with pytest.raises(ServeError):
        serve_stage.start(tmp_path / "repo")
    assert len(made) == 1 and made[0].name.startswith("trt-diffusion-serve-") and not made[0].exists()


def test_a_stopped_server_removes_the_work_folder_made_for_it(tmp_path):
    from trt_diffusion.triton.server import TritonServer

    work = tmp_path / "trt-diffusion-serve-x"
    (work / "backends").mkdir(parents=True)
    TritonServer(tmp_path / "repo", work, remove_work_dir=True).stop()
    assert not work.exists()
    kept = tmp_path / "mine"
    kept.mkdir()
    TritonServer(tmp_path / "repo", kept).stop()  # a folder the caller gave is the caller's
    assert kept.is_dir()
