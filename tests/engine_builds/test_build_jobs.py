"""`build --jobs 2` with the memory budget (build.memory_budget_gb): two builds really run at once when the
budget holds both, one at a time when a single build's estimate exceeds it. Events, not timings: each build
is counted in and out, and with room for two the builds meet at a barrier (which only two concurrent builds
can pass)."""

from __future__ import annotations

import shutil
import threading

import pytest
import yaml

from trt_diffusion.cli import main
from trt_diffusion.engine_builds import stage
from trt_diffusion.engine_builds.build_state import STATE_FILE
from trt_diffusion.engines_file import expand, load_engines_file
from trt_diffusion.targets.onnxruntime.engine import engine_dir

HANG_GUARD_S = 120  # a barrier nobody else reaches: a failure, not slowness


def _workspace_without_engines(tmp_path, built_sd15, **build_fields):
    """The shared build's workspace with its exports but no engines: `build` builds all four again."""
    workspace = tmp_path / "build"
    shutil.copytree(built_sd15.parent / "build", workspace, ignore=shutil.ignore_patterns("reports"))
    data = yaml.safe_load(built_sd15.read_text())
    data["build"] = {**data["build"], "workspace": str(workspace), **build_fields}
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(data))
    (workspace / STATE_FILE).unlink(missing_ok=True)
    specs = expand(load_engines_file(path))
    for spec in specs:
        shutil.rmtree(engine_dir(workspace, spec))
    return path, specs


class Concurrency:
    """Wraps stage.build_one: counts builds in flight; with `meet`, pairs of builds wait for each other."""

    def __init__(self, monkeypatch, meet: bool):
        self.real, self.lock, self.now, self.most, self.built = stage.build_one, threading.Lock(), 0, 0, []
        self.barrier = threading.Barrier(2, timeout=HANG_GUARD_S) if meet else None
        monkeypatch.setattr(stage, "build_one", self)

    def __call__(self, config, spec, onnx_path):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            if self.barrier is not None:
                self.barrier.wait()  # passes only when a second build is running at the same time
            result = self.real(config, spec, onnx_path)
            self.built.append(spec.name)
            return result
        finally:
            with self.lock:
                self.now -= 1


def test_two_jobs_build_two_engines_at_once_within_the_budget(tmp_path, built_sd15, monkeypatch):
    path, specs = _workspace_without_engines(tmp_path, built_sd15)  # default budget: 16 GB, room for both
    assert len(specs) == 4  # pairs at the barrier: an even count
    tracker = Concurrency(monkeypatch, meet=True)
    assert main(["build", str(path), "--jobs", "2"]) == 0
    assert tracker.most == 2 and sorted(tracker.built) == sorted(s.name for s in specs)


def test_a_budget_smaller_than_one_build_runs_them_one_at_a_time(tmp_path, built_sd15, monkeypatch):
    path, specs = _workspace_without_engines(tmp_path, built_sd15, memory_budget_gb=1e-6)  # 1 KiB
    estimates = [stage.memory_estimate(onnx) for onnx in (tmp_path / "build" / "onnx").glob("*/model.onnx")]
    assert estimates and min(estimates) > 1024  # every build alone is larger than the whole budget
    tracker = Concurrency(monkeypatch, meet=False)
    assert main(["build", str(path), "--jobs", "2"]) == 0
    assert tracker.most == 1 and sorted(tracker.built) == sorted(s.name for s in specs)


@pytest.mark.parametrize("budget", [1e-6, 16.0])
def test_every_engine_is_built_and_current_after_a_parallel_build(tmp_path, built_sd15, budget):
    path, specs = _workspace_without_engines(tmp_path, built_sd15, memory_budget_gb=budget)
    assert main(["build", str(path), "--jobs", "2"]) == 0
    config = load_engines_file(path)
    from trt_diffusion.runtime.loader import built_engines

    assert len(built_engines(config, "sd15-tiny", "onnxruntime")) == len(specs)
