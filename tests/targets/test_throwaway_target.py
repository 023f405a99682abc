"""A target defined here, in the test, registered at run time: the conformance suite runs for it, and it
takes the tiny default through plan -> build -> parity -> package with no edit outside this file.

It stores the exported ONNX as it is (one folder per engine, built and sealed by the skeleton every folder
target shares, targets/engine_folder.py) and runs it with ONNX Runtime: the simplest engine a target can make,
enough to show the stages know targets only through the protocol.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import yaml
from target_conformance import TargetConformance

from trt_diffusion import api
from trt_diffusion.errors import BuildError, RefitError
from trt_diffusion.onnx_facts import onnx_io, onnx_sha256
from trt_diffusion.targets import (
    BuildRequest,
    TargetBase,
    TritonEngineModel,
    register_target,
    target_names,
    unregister_target,
)
from trt_diffusion.targets.engine_folder import EngineFolders, FolderEngineManifest, input_hash

NAME = "throwaway"
THIS_FILE = Path(__file__).resolve()
MODEL_FILE = "model.onnx"


class ThrowawayManifest(FolderEngineManifest):
    target: str = NAME


FOLDERS = EngineFolders(NAME, ThrowawayManifest, lambda folder: onnx_sha256(folder / MODEL_FILE),
                        unreadable=(BuildError,))


class ThrowawayTarget(TargetBase):
    name = NAME

    def unavailable_reason(self):
        return None

    def build_options(self, config):
        return {"throwaway_format": 1}

    @staticmethod
    def _built_from(request: BuildRequest) -> str:
        return input_hash({"onnx": onnx_sha256(request.onnx_path), "spec": request.spec.key})

    def is_current(self, request: BuildRequest) -> bool:
        folder = FOLDERS.folder(request.workspace, request.spec)
        return FOLDERS.trusted(folder, self._built_from(request)) is not None

    def build(self, request: BuildRequest):
        final = FOLDERS.folder(request.workspace, request.spec)
        if self.is_current(request):
            return final, True
        start = time.perf_counter()
        source = Path(request.onnx_path)
        with FOLDERS.staging(final) as tmp:
            for file in source.parent.iterdir():  # the ONNX's external data, under its own names
                if file.is_file() and file.name.startswith(source.name) and file != source:
                    shutil.copyfile(file, tmp / file.name)
            shutil.copyfile(source, tmp / MODEL_FILE)
            if request.write_refit_map is not None:
                request.write_refit_map(tmp / MODEL_FILE, tmp)
            inputs, outputs = onnx_io(tmp / MODEL_FILE)
            FOLDERS.seal(tmp, final, spec=request.spec, built_from=self._built_from(request),
                         onnx_sha256=onnx_sha256(source), profile=request.profile, inputs=inputs, outputs=outputs,
                         started=start)
        return final, False

    def find(self, workspace, spec):
        return FOLDERS.find(workspace, spec)

    def runner(self, engine, weights=None):
        if weights:
            raise RefitError("the throwaway target does not refit")
        return self.runner_from_files(engine.path, engine.spec.name)

    def refit(self, engine, weights, source_onnx):
        raise RefitError("the throwaway target does not refit")

    def triton_model(self, engine, *, engine_backend):
        files = {p.name: p for p in Path(engine.path).iterdir() if p.is_file()}
        return TritonEngineModel("python", "KIND_CPU", files)

    def runner_from_files(self, folder, name):
        from trt_diffusion.targets.onnxruntime.runner import OnnxRuntimeRunner

        return OnnxRuntimeRunner(Path(folder) / MODEL_FILE, name=name)


REGISTER = f"""
import importlib.util
from trt_diffusion.targets import register_target
_spec = importlib.util.spec_from_file_location("throwaway_target_module", {str(THIS_FILE)!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
register_target({NAME!r}, _module.ThrowawayTarget())
"""


@pytest.fixture(autouse=True, scope="module")
def registered():
    register_target(NAME, ThrowawayTarget())
    yield
    unregister_target(NAME)


class TestThrowawayConformance(TargetConformance):
    target_name = NAME
    child_setup = REGISTER


def test_plan_build_parity_package_with_a_target_the_tree_does_not_know(tmp_path, built_sd15):
    assert NAME in target_names()
    data = yaml.safe_load(built_sd15.read_text())
    workspace = tmp_path / "build"
    shutil.copytree(built_sd15.parent / "build" / "onnx", workspace / "onnx")  # reuse the verified exports
    data["build"]["workspace"] = str(workspace)
    data["models"]["sd15-tiny"]["targets"] = [NAME]
    config = tmp_path / "engines.yaml"
    config.write_text(yaml.safe_dump(data))

    plan = api.plan(config, count_parameters=False)
    assert {row.target for row in plan.rows} == {NAME}

    report = api.build(config)
    assert not report.failed and len(report.built) == 4, [o.error for o in report.failed]
    assert all(o.path.parent == workspace / "engines" / NAME for o in report.outcomes)
    assert all(dict(o.spec.build_options)["throwaway_format"] == 1 for o in report.outcomes)
    assert len(api.build(config).cached) == 4

    run = api.parity(config, out_dir=tmp_path / "parity", steps=2, seeds=[0])
    assert run.report.passed and {v.target for v in run.report.variants} == {NAME}

    from trt_diffusion.triton.stage import package_stage

    packaged = package_stage(config, tmp_path / "repo", NAME)
    engines = [m for m in packaged.models if m.role == "engine"]
    assert len(engines) == 4 and all(m.backend == "python" for m in engines)
    for model in engines:
        version = tmp_path / "repo" / model.name / "1"
        assert (version / "model.py").is_file() and (version / "manifest.json").is_file()
