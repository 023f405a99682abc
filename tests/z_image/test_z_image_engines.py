"""Z-Image engines end to end (issue #42, acceptance 4): the tiny folder exported (the transformer's graph dynamic
over batch, latent size and the text axis), built on onnxruntime and openvino, and passing the fp32 parity gate
against the torch reference (which equals ZImagePipeline: test_z_image_reference.py) with CFG as one batch-2 call.
Slow: one export and six builds (about 1.5 minutes on 2 loaded cores)."""

from __future__ import annotations

import onnx
import pytest
import yaml

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.parity.stage import ParityOptions, run_parity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TARGETS = ("onnxruntime", "openvino")
FP32 = {"text_encoder": "fp32", "transformer": "fp32", "vae_decoder": "fp32"}


@pytest.fixture(scope="module")
def built(tiny_model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("z-image-engines")
    models = {"z_image-tiny": {"source": str(tiny_model_factory("z_image")), "family": "z_image",
                               "buckets": ["64x64"], "targets": list(TARGETS), "precision": dict(FP32)}}
    path = root / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build"}, "models": models}))
    report = api.build(path)
    assert not report.failed, [o.error for o in report.failed]
    return path, report


def test_builds_on_both_cpu_targets_with_the_batch_two_transformer(built):
    path, report = built
    done = {(o.spec.component.value, o.spec.target, o.spec.batch) for o in report.outcomes if o.failure is None}
    assert done == {(c, t, 2 if c == "transformer" else 1) for c in FP32 for t in TARGETS}
    (transformer,) = [r for r in api.export(path).results if r.group.name == "z_image-tiny.transformer.fp32"]
    graph = onnx.load(str(transformer.onnx_path), load_external_data=False)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.graph.input}
    assert dims == {"hidden_states": ["batch", 16, "latent_height", "latent_width"], "timestep": ["batch"],
                    "encoder_hidden_states": ["batch", "text_tokens", 16],
                    "encoder_hidden_states_mask": ["batch", "text_tokens"]}
    assert transformer.dynamic_ranges["text_tokens"] == [2, 512]
    assert all(check["passed"] for check in transformer.parity) and len(transformer.parity) == 3


def test_engines_pass_parity(built, tmp_path):
    path, _ = built
    run = run_parity(load_engines_file(path, check_sources=True), tmp_path / "parity",
                     ParityOptions(prompts=("a red fox running through snow",), seeds=(0,), steps=3,
                                   compute_lpips=False))
    variants = {(v.model, v.target): v for v in run.report.variants}
    assert set(variants) == {("z_image-tiny", t) for t in TARGETS}
    for key, result in variants.items():
        assert result.passed, (key, result.failure_reasons)
