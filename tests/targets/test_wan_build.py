"""Wan engines on the CPU targets: the 5-D transformer and the whole-clip VAE decoder build on onnxruntime and
openvino, are found through their manifests, and compute what the PyTorch components compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trt_diffusion import api
from trt_diffusion.components import Geometry, get_component, load_model_config
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.models.loading import load_component
from trt_diffusion.targets import get_target

TARGETS = ("onnxruntime", "openvino")


@pytest.fixture(scope="module")
def wan_build(tiny_model_factory, tmp_path_factory, write_engines_yaml):
    model_dir = tiny_model_factory("wan")
    path = write_engines_yaml(tmp_path_factory.mktemp("wan-build"), model_dir, "wan", buckets=["32x32x5"],
                              components=["transformer", "vae_decoder"], targets=list(TARGETS),
                              precision={"transformer": "fp32", "vae_decoder": "fp32"})
    return load_engines_file(path), api.build(path), model_dir


@pytest.mark.slow  # two dynamo exports (transformer, 5-frame VAE decoder) and four engines: about 50 s
@pytest.mark.parametrize("target_name", TARGETS)
def test_wan_engines_build_are_found_and_match_torch(wan_build, target_name):
    config, report, model_dir = wan_build
    target = get_target(target_name)
    if (reason := target.unavailable_reason()) is not None:
        pytest.skip(f"{target_name} is not available here: {reason}")
    assert not report.failed, [o.error for o in report.failed]
    outcomes = [o for o in report.outcomes if o.spec.target == target_name]
    assert sorted(o.spec.name for o in outcomes) == ["wan-tiny.transformer.32x32x5.b2.fp32",
                                                     "wan-tiny.vae_decoder.32x32x5.b1.fp32"]
    for outcome in outcomes:
        spec = outcome.spec
        engine = target.find(config.workspace, spec)
        assert engine is not None and engine.path == outcome.path
        definition = get_component(spec.family, spec.component)
        model_config = load_model_config(model_dir, spec.family, spec.component)
        feeds = definition.dummy_inputs(model_config, {}, Geometry(spec.batch, spec.bucket.opt))
        reference = definition.wrapper(load_component(model_dir, spec.component), model_config, {})
        with torch.inference_mode():
            expected = reference(*[torch.from_numpy(feeds[n]) for n in definition.io(model_config, {}).input_names])
        (name,) = definition.io(model_config, {}).output_names
        got = target.runner(engine).run(feeds)[name]
        assert got.shape == tuple(expected.shape) == {"transformer": (2, 16, 2, 4, 4),
                                                      "vae_decoder": (1, 3, 5, 32, 32)}[spec.component]
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-4 * max(1.0, float(expected.abs().max())))
