"""Preflight runs a step-cached model's cached schedule (engines.yaml's step_cache, on by default), as the server
does: the in-process deployment's images are the cached pipeline's, and the checks pass over it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.preflight import connect
from trt_diffusion.preflight.checks.base import CheckContext
from trt_diffusion.preflight.run import run_check
from trt_diffusion.runtime.loader import engine_runners
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.triton.client import ImageRequest

from .conftest import FAST

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cached_yaml(built_sd15_step_cache, tmp_path_factory) -> Path:
    document = yaml.safe_load(Path(built_sd15_step_cache).read_text())
    document["build"]["workspace"] = str((Path(built_sd15_step_cache).parent / document["build"]["workspace"]).resolve())
    document["preflight"] = FAST
    path = tmp_path_factory.mktemp("preflight-step-cache") / "engines.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def test_the_deployment_runs_the_cached_schedule_and_reproducibility_passes(cached_yaml):
    config = load_engines_file(cached_yaml)
    (model,) = config.models
    engines = connect.find_engines(config, model, "onnxruntime")
    deployment = connect.in_process(config, engines)
    request = ImageRequest("a red fox", 64, 64, steps=4, guidance_scale=5.0, seed=2)
    served = deployment.generate(request, timeout_s=120)
    model_dir, family, table = engine_runners(config, model, "onnxruntime")
    cached = EnginePipeline(model_dir, family, table, step_cache=config.models[model].step_cache)
    fields = dict(prompt="a red fox", height=64, width=64, steps=4, guidance_scale=5.0, seed=2)
    np.testing.assert_array_equal(served, cached.generate(GenerationRequest(**fields)).images[0])
    assert not np.array_equal(served, cached.generate(GenerationRequest(**fields, step_cache="off")).images[0])
    result = run_check("reproducibility", CheckContext(config, model, "onnxruntime", config.preflight, deployment,
                                                       engines))
    assert result.status == "pass", result.failures
