"""The image workflows through engines for the other families (slow: each builds its tiny model's engines):
sdxl, sd3 and flux img2img and inpaint on onnxruntime within the fp32 parity gate of the torch reference, and
FLUX.1 Kontext edit served by tritonserver over HTTP and gRPC equal to the in-process pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.parity.stage import ParityOptions, run_parity
from trt_diffusion.sample_inputs import init_image

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FP32 = {"sdxl": ["text_encoder", "text_encoder_2", "unet", "vae_decoder"],
        "sd3": ["text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_decoder"],
        "flux": ["text_encoder", "text_encoder_2", "transformer", "vae_decoder"]}


@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux"])
def test_img2img_and_inpaint_engines_pass_parity(tiny_model_factory, write_engines_yaml, tmp_path, family):
    config = write_engines_yaml(tmp_path, tiny_model_factory(family), family,
                                workflows=["txt2img", "img2img", "inpaint"],
                                precision={c: "fp32" for c in FP32[family]})
    report = api.build(config, target="onnxruntime")
    assert not report.failed, [o.error for o in report.failed]
    run = run_parity(load_engines_file(config, check_sources=True), tmp_path / "parity",
                     ParityOptions(prompts=("a lighthouse at dusk",), seeds=(0,), compute_lpips=False))
    by_workflow = {v.workflow: v for v in run.report.variants}
    assert set(by_workflow) == {"txt2img", "img2img", "inpaint"}
    for variant in by_workflow.values():
        assert variant.passed, (variant.workflow, variant.failure_reasons)


@pytest.mark.triton
def test_kontext_edit_served_equals_in_process(tiny_model_factory, write_engines_yaml, tmp_path):
    from trt_diffusion.runtime.loader import built_engines, table_from_engines
    from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
    from trt_diffusion.triton import client as triton_client
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.client import ImageRequest
    from trt_diffusion.triton.repository import PackageOptions

    config_path = write_engines_yaml(tmp_path, tiny_model_factory("flux", variant="kontext"), "flux",
                                     precision={c: "fp32" for c in FP32["flux"]})
    report = api.build(config_path, target="onnxruntime")
    assert not report.failed, [o.error for o in report.failed]
    config = load_engines_file(config_path, check_sources=True)
    (name,) = config.models
    model = config.models[name]
    local = EnginePipeline(model.source.path, "flux", table_from_engines(built_engines(config, name, "onnxruntime")),
                           workflows=model.workflows)
    image = init_image(64, 64, 5)
    expected = local.generate(GenerationRequest("make it night", 64, 64, steps=3, guidance_scale=3.5, seed=5,
                                                workflow="edit", init_image=image)).images[0]
    packaged = stage.package_stage(config_path, tmp_path / "repo", options=PackageOptions(ensemble=False,
                                                                                           stream=False))
    assert packaged.workflows == ["edit"]
    server, _ = stage.start(tmp_path / "repo", work_dir=tmp_path / "work", first_request=False)
    try:
        for protocol in ("http", "grpc"):
            url = server.http_url if protocol == "http" else server.grpc_url
            client = triton_client.connect(url, protocol, 120.0)
            try:
                got = triton_client.infer(client, triton_client.client_module(protocol), packaged.entry,
                                          ImageRequest("make it night", 64, 64, 3, 3.5, 5, workflow="edit",
                                                       init_image=image), protocol=protocol, timeout_s=120.0, url=url)
            finally:
                client.close()
            np.testing.assert_array_equal(got, expected)
    finally:
        server.stop()
