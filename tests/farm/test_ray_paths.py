"""Paths crossing the Ray driver/worker boundary (issue 32, finding 9): relative to the workspace and checked
on arrival. A worker no longer uses the driver's absolute paths as they are, and the driver no longer walks
whatever path a build task returns (`/` would walk the filesystem). The functions the tasks and the driver
run, called directly (the cluster itself runs in the slow tests of test_ray_cluster.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from target_conformance import make_spec

from trt_diffusion.engine_builds import ray_executor
from trt_diffusion.errors import BuildError


@pytest.fixture
def config(tmp_path):
    workspace = tmp_path / "ws"
    (workspace / "onnx" / "unet.0123456789abcdef").mkdir(parents=True)
    (workspace / "engines" / "onnxruntime" / "e.0123456789abcdef").mkdir(parents=True)
    return SimpleNamespace(workspace=workspace.resolve(), path=tmp_path / "engines.yaml")


def test_sources_cross_as_workspace_relative_paths(config, tmp_path):
    onnx = config.workspace / "onnx" / "unet.0123456789abcdef" / "model.onnx"
    assert ray_executor._portable(config, onnx) == "onnx/unet.0123456789abcdef/model.onnx"
    assert ray_executor._local_source(config, "onnx/unet.0123456789abcdef/model.onnx") == onnx
    with pytest.raises(BuildError, match="outside the workspace"):
        ray_executor._portable(config, tmp_path / "elsewhere.onnx")


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.onnx", "onnx/../../x", ""])
def test_a_worker_refuses_a_source_outside_the_workspace(config, path):
    with pytest.raises(BuildError, match=r"a Ray task's ONNX source"):
        ray_executor._local_source(config, path)


def test_a_worker_refuses_a_source_through_a_link(config, tmp_path):
    os.symlink(tmp_path, config.workspace / "onnx" / "link")
    with pytest.raises(BuildError, match=r"symbolic link"):
        ray_executor._local_source(config, "onnx/link/model.onnx")


@pytest.mark.parametrize("path", ["/", str(os.path.expanduser("~")), "../..", "onnx/unet.0123456789abcdef", 3])
def test_the_driver_refuses_an_engine_path_it_should_not_walk(config, path):
    spec = make_spec("onnxruntime")
    outcome = ray_executor._outcome(config, spec, {"path": path, "cached": False, "seconds": 1.0})
    assert outcome.failure is not None and outcome.path is None
    assert "Ray task's engine path" in outcome.failure.message or "not under engines/" in outcome.failure.message
    good = ray_executor._outcome(config, spec, {"path": "engines/onnxruntime/e.0123456789abcdef", "cached": True,
                                                "seconds": 1.0})
    assert good.failure is None and good.path == config.workspace / "engines/onnxruntime/e.0123456789abcdef"
