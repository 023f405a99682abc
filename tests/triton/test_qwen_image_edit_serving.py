"""Qwen-Image-Edit's engines (issue #26), slow: the tiny edit checkpoint's five engines built at one non-square
bucket on onnxruntime and openvino (the vision tower traced at the bucket's reference grid, the encoder over the
image's embeddings, the transformer over the reference tokens, the VAE encoder at the reference's 832x1248), then

- `trt-diffusion parity`: both targets' edits against the torch reference, true CFG on;
- served over Triton: edits over HTTP and gRPC, true CFG and NUM_IMAGES 2, bit-equal to the in-process pipeline
  over the same engines; a reference image of another aspect, an over-long prompt and MAX_SEQUENCE_LENGTH are each
  one clear error, the server healthy after.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from trt_diffusion.errors import ServeError
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.sample_inputs import init_image
from trt_diffusion.triton.client import ImageRequest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WIDTH, HEIGHT = 64, 96  # tall: the reference is resized to 832x1248 (1350 image tokens in the prompt)
TEXT_LENGTHS = (2, 64, 256)
PROMPT = "make the sky stormy"
NEGATIVE = "blurry"


@pytest.fixture(scope="module")
def edit_workspace(tiny_model_factory, tmp_path_factory) -> Path:
    from trt_diffusion import api

    root = tmp_path_factory.mktemp("qwen-edit")
    components = ["text_encoder", "image_encoder", "transformer", "vae_encoder", "vae_decoder"]
    model = {"source": str(tiny_model_factory("qwen_image", variant="edit")), "family": "qwen_image",
             "buckets": [f"{WIDTH}x{HEIGHT}"], "batch": [1], "cfg": ["split"],
             "targets": ["onnxruntime", "openvino"], "precision": {c: "fp32" for c in components},
             "text_length": dict(zip(("min", "opt", "max"), TEXT_LENGTHS))}
    path = root / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": str(root / "build")},
                                    "models": {"edit": model}}, sort_keys=False))
    report = api.build(path)
    assert not report.failed, [o.error for o in report.failed]
    return path


def test_parity_passes_on_both_cpu_targets(edit_workspace, tmp_path):
    """One prompt at 2 steps (the slow suite's budget: each edit call runs ~1,400 prompt positions and ~1,400
    reference tokens); `trt-diffusion parity`'s defaults were run by hand (docs/qwen-image.md)."""
    from trt_diffusion import api

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    run = api.parity(edit_workspace, out_dir=tmp_path / "parity", targets=["onnxruntime", "openvino"],
                     prompts_file=prompts, steps=2)
    assert {(v.target, v.workflow) for v in run.report.variants} == {("onnxruntime", "edit"), ("openvino", "edit")}
    assert run.report.passed, [(v.target, v.failure_reasons) for v in run.report.variants]


@pytest.fixture(scope="module")
def local_pipeline(edit_workspace):
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import engine_runners

    config = load_engines_file(edit_workspace, check_sources=True)
    model_dir, family, table = engine_runners(config, "edit", "onnxruntime")
    return EnginePipeline(model_dir, family, table, text_lengths=TEXT_LENGTHS)


@pytest.fixture(scope="module")
def server(edit_workspace, tmp_path_factory):
    from trt_diffusion.triton import stage

    root = tmp_path_factory.mktemp("qwen-edit-repo")
    stage.package_stage(edit_workspace, root / "repo", target="onnxruntime")
    served, warm = stage.start(root / "repo", work_dir=root / "work", first_request=True)
    try:
        yield SimpleNamespace(server=served, warmup=warm, repo=root / "repo")
    finally:
        served.stop()


def edit_request(**change) -> ImageRequest:
    values = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH, steps=2, guidance_scale=4.0,
                  seed=5, workflow="edit", init_image=init_image(HEIGHT * 2, WIDTH * 2, 5))  # the same aspect, larger
    values.update(change)
    return ImageRequest(**values)


@pytest.fixture(scope="module")
def expected(local_pipeline):
    """The in-process images of the default edit request, seeds SEED and SEED + 1 (computed once)."""
    return [local(local_pipeline, edit_request(), k) for k in range(2)]


def local(pipeline, request: ImageRequest, seed_offset: int = 0) -> np.ndarray:
    return pipeline.generate(GenerationRequest(
        prompt=request.prompt, negative_prompt=request.negative_prompt, height=request.height, width=request.width,
        steps=request.steps, guidance_scale=request.guidance_scale, seed=request.seed + seed_offset,
        workflow=request.workflow, init_image=request.init_image)).images[0]


def served_images(server, request: ImageRequest, protocol: str) -> np.ndarray:
    from trt_diffusion.triton import client as triton_client

    url = server.server.http_url if protocol == "http" else server.server.grpc_url
    return triton_client.generate_images(url, request, protocol=protocol)[0]


@pytest.mark.triton
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_edits_equal_the_in_process_pipeline(server, expected, protocol):
    images = served_images(server, edit_request(num_images=2), protocol)
    assert images.shape == (2, HEIGHT, WIDTH, 3) and images.dtype == np.uint8
    for k in range(2):
        np.testing.assert_array_equal(images[k], expected[k])
    assert not np.array_equal(images[0], images[1])


@pytest.mark.triton
@pytest.mark.parametrize("change,message", [
    (dict(init_image=init_image(64, 64, 1)), "INIT_IMAGE is 64x64: Qwen-Image-Edit resizes it to 1024x1024, but a "
                                             "64x96 request's reference is resized to 832x1248"),
    (dict(prompt="storm " * 80), r"PROMPT has \d+ tokens with the edit template.s tail; the engines take at most 256"),
    (dict(max_sequence_length=32), "MAX_SEQUENCE_LENGTH is not an edit's"),
])
def test_a_bad_edit_is_one_clear_error_and_the_server_stays_up(server, expected, change, message):
    with pytest.raises(ServeError, match=message):
        served_images(server, edit_request(**change), "http")
    np.testing.assert_array_equal(served_images(server, edit_request(), "grpc")[0], expected[0])
