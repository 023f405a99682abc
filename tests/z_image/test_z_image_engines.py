"""Z-Image engines end to end (issue #42, acceptance 4): the tiny folder exported (the transformer's graph dynamic
over batch, latent size and the text axis), built on onnxruntime and openvino, and passing the fp32 parity gate
against the torch reference (which equals ZImagePipeline: test_z_image_reference.py) with CFG as one batch-2 call;
the onnxruntime engines served by tritonserver equal the in-process pipeline. Slow: the build is the session's
`built_z_image` (conftest.py; one export and six builds, shared with test_z_image_lora.py), then one parity run
(two steps, one seed) and one server."""

from __future__ import annotations

import onnx
import pytest

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.parity.stage import ParityOptions, run_parity

from .conftest import FP32, MODEL, TARGETS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_builds_on_both_cpu_targets_with_the_batch_two_transformer(built_z_image):
    path, report = built_z_image
    done = {(o.spec.component.value, o.spec.target, o.spec.batch) for o in report.outcomes if o.failure is None}
    assert done == {(c, t, 2 if c == "transformer" else 1) for c in FP32 for t in TARGETS}
    (transformer,) = [r for r in api.export(path).results if r.group.name == f"{MODEL}.transformer.fp32"]
    graph = onnx.load(str(transformer.onnx_path), load_external_data=False)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.graph.input}
    assert dims == {"hidden_states": ["batch", 16, "latent_height", "latent_width"], "timestep": ["batch"],
                    "encoder_hidden_states": ["batch", "text_tokens", 16],
                    "encoder_hidden_states_mask": ["batch", "text_tokens"]}
    assert transformer.dynamic_ranges["text_tokens"] == [2, 512]
    assert all(check["passed"] for check in transformer.parity) and len(transformer.parity) == 3


def test_engines_pass_parity(built_z_image, tmp_path):
    path, _ = built_z_image
    run = run_parity(load_engines_file(path, check_sources=True), tmp_path / "parity",
                     ParityOptions(prompts=("a red fox running through snow",), seeds=(0,), steps=2,
                                   compute_lpips=False))
    variants = {(v.model, v.target): v for v in run.report.variants}
    assert set(variants) == {(MODEL, t) for t in TARGETS}
    for key, result in variants.items():
        assert result.passed, (key, result.failure_reasons)


@pytest.fixture(scope="module")
def served(built_z_image, tmp_path_factory):
    """The onnxruntime engines packaged as a Triton repository (the entry and the stream: no ensemble), served."""
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.repository import PackageOptions

    path, _ = built_z_image
    root = tmp_path_factory.mktemp("z_image-repo")
    report = stage.package_stage(path, root / "repo", model=MODEL, options=PackageOptions(ensemble=True))
    assert report.ensemble is None  # its prompt states carry a mask and a length per prompt
    server, _ = stage.start(root / "repo", work_dir=root / "work", first_request=False)
    try:
        yield server, report, load_engines_file(path, check_sources=True)
    finally:
        server.stop()


@pytest.mark.triton
def test_served_images_equal_the_in_process_pipeline(served):
    """Over gRPC and HTTP, NUM_IMAGES 2 (seeds SEED and SEED + 1), the entry's images equal the in-process
    EnginePipeline's over the same engines bit for bit: Z-Image with CFG (batched) and Z-Image-Turbo's request
    (8 steps, guidance 0), and the family's request inputs CFG_NORMALIZATION / CFG_TRUNCATION (over gRPC)."""
    import numpy as np

    from trt_diffusion.runtime.loader import built_engines, table_from_engines
    from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
    from trt_diffusion.triton import client
    from trt_diffusion.triton.client import ImageRequest

    server, report, config = served
    local = EnginePipeline(config.models[MODEL].source.path, "z_image",
                           table_from_engines(built_engines(config, MODEL, "onnxruntime")))
    inputs = {"cfg_normalization": 0.9, "cfg_truncation": 0.5}
    for guidance, steps, protocol, url, extra in ((5.0, 2, "grpc", server.grpc_url, {}),
                                                  (0.0, 8, "http", server.http_url, {}),
                                                  (5.0, 3, "grpc", server.grpc_url, inputs)):
        request = ImageRequest(prompt="a red fox running through snow", height=64, width=64, steps=steps,
                               guidance_scale=guidance, seed=5, num_images=2, inputs=extra or None)
        images, _ = client.generate_images(url, request, pipeline=report.entry, protocol=protocol)
        assert images.shape == (2, 64, 64, 3)
        for k in range(2):
            expected = local.generate(GenerationRequest(prompt=request.prompt, height=64, width=64, steps=steps,
                                                        guidance_scale=guidance, seed=5 + k,
                                                        inputs=dict(extra))).images[0]
            np.testing.assert_array_equal(images[k], expected)
