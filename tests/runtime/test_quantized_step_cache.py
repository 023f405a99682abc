"""The quantized cached pipeline (issue 47, acceptance 1): int8 DeepCache on the tiny sd15 — the UNet and its
unet_deep / unet_shallow pieces quantized from one calibration, built on onnxruntime and openvino from their Q/DQ
graphs, parity-checked against the fp32 *uncached* reference on the looser of the cache's and int8's bars, served
through Triton equal to the in-process pipeline, and a refit LoRA switched A -> B -> A on the quantized pieces with
the A images equal bit for bit; and int8 first-block caching on the tiny FLUX built, parity-checked and served
through Triton equal to the in-process pipeline.

Before the change engines.yaml refused the cache ("step caching with an int8 unet is not supported yet").
Slow: three quantized graphs, three fp32 exports and ten engines (FLUX: its own build).
The whole file: 179 s on 2 cores under light load (sd15 build 77 s, Triton start 37 s, FLUX 48 s); 25 + 16 min
under load 7-8 from other jobs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.runtime.loader import engine_runners
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

NAME = "sd15-tiny"
CACHE = {"method": "deepcache", "interval": 3, "branch": 0}
QUANTIZATION = {"calibration": {"samples": 2, "steps": 2, "seed": 0}}
PRECISION = {"text_encoder": "fp32", "unet": "int8", "vae_decoder": "fp32"}


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_sd15_dir, write_engines_yaml):
    root = tmp_path_factory.mktemp("quantized-step-cache")
    path = write_engines_yaml(root, tiny_sd15_dir, "sd15", workspace=str(root / "build"), precision=PRECISION,
                              targets=["onnxruntime", "openvino"], quantization=QUANTIZATION, step_cache=CACHE)
    report = api.build(path)
    assert not report.failed, [o.error for o in report.failed]
    return path


def test_parity_judges_the_cached_int8_pipeline_against_the_uncached_fp32_one(built, tmp_path):
    run = api.parity(built, out_dir=tmp_path / "parity")
    variants = {v.variant_id: v for v in run.report.variants}
    for target in ("onnxruntime", "openvino"):
        plain, cached = variants[f"{NAME}/{target}/64x64"], variants[f"{NAME}/{target}/64x64/step-cache"]
        assert plain.passed and plain.precision == "int8", plain.failure_reasons
        assert cached.passed, cached.failure_reasons
        assert cached.step_schedule == "FccF"  # 4 steps at interval 3
        # the looser of deepcache's 24 dB / 0.80 and int8's 20 dB / 0.80
        assert (cached.thresholds.min_psnr_db, cached.thresholds.min_ssim) == (20.0, 0.80)
        assert all(0 < image.psnr_db < 100 for image in cached.images)  # the cache changed the images
        engines = {c.component for c in plain.components}  # the quantized pieces diffed against their fp32 graphs
        assert {f"{NAME}.unet_deep.64x64.b2.int8", f"{NAME}.unet_shallow.64x64.b2.int8"} <= engines


@pytest.fixture(scope="module")
def server(built, tmp_path_factory):
    from trt_diffusion.triton import stage

    root = tmp_path_factory.mktemp("quantized-step-cache-repo")
    stage.package_stage(built, root / "repo")
    served, _ = stage.start(root / "repo", work_dir=root / "work", first_request=True)
    try:
        yield SimpleNamespace(server=served, repo=root / "repo")
    finally:
        served.stop()


def _request(**change) -> dict:
    return {"prompt": "a lighthouse on a cliff at dusk", "height": 64, "width": 64, "steps": 5,
            "guidance_scale": 5.0, "seed": 4, **change}


@pytest.mark.triton
def test_the_served_cached_int8_pipeline_equals_the_in_process_one(built, server):
    from trt_diffusion.triton import client as triton_client
    from trt_diffusion.triton.client import ImageRequest

    config = load_engines_file(built, check_sources=True)
    model_dir, family, table = engine_runners(config, NAME, "onnxruntime")
    pipe = EnginePipeline(model_dir, family, table, step_cache=config.models[NAME].step_cache)
    cached = pipe.generate(GenerationRequest(**_request(), step_cache="on"))
    assert cached.timings.step_schedule == "FccFc"
    uncached = pipe.generate(GenerationRequest(**_request(), step_cache="off")).images[0]
    assert not np.array_equal(cached.images[0], uncached)
    served = triton_client.generate_images(server.server.grpc_url, ImageRequest(**_request()), protocol="grpc")[0][0]
    np.testing.assert_array_equal(served, cached.images[0])


def test_a_refit_lora_switches_a_b_a_on_the_quantized_pieces(built, tiny_sd15_dir, write_engines_yaml, tmp_path):
    lora = tiny_sd15_dir / "lora/pytorch_lora_weights.safetensors"
    workspace = load_engines_file(built).workspace  # the same quantized graphs (refittable changes only engines)
    path = write_engines_yaml(tmp_path, tiny_sd15_dir, "sd15", workspace=str(workspace), precision=PRECISION,
                              quantization=QUANTIZATION, step_cache=CACHE,
                              loras={"style": {"source": str(lora), "mode": "refit"}})
    report = api.build(path, target="onnxruntime")
    assert not report.failed, [o.error for o in report.failed]
    config = load_engines_file(path)
    cache = config.models[NAME].step_cache

    def images(loras):
        model_dir, family, table = engine_runners(config, NAME, "onnxruntime", loras=loras)
        generation = EnginePipeline(model_dir, family, table, step_cache=cache).generate(
            GenerationRequest(**_request(steps=6), step_cache="on"))
        assert generation.timings.step_schedule == "FccFcc"
        return generation.images

    a, b, base = images([(lora, 1.0)]), images([(lora, -1.0)]), images(None)
    assert not np.array_equal(a, b) and not np.array_equal(a, base)
    np.testing.assert_array_equal(images([(lora, 1.0)]), a)  # A -> B -> A: no residue of B
    np.testing.assert_array_equal(images(None), base)


FLUX_NAME = "flux-tiny"
FLUX_CACHE = {"method": "first_block", "threshold": 0.6}  # skips steps on random weights: docs/step-cache.md


@pytest.fixture(scope="module")
def built_flux(tiny_model_factory, write_engines_yaml, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-first-block")
    path = write_engines_yaml(root, tiny_model_factory("flux"), "flux", workspace=str(root / "build"), cfg=["none"],
                              precision={"text_encoder": "fp32", "text_encoder_2": "fp32", "transformer": "int8",
                                         "vae_decoder": "fp32"},
                              targets=["onnxruntime"], quantization=QUANTIZATION, step_cache=FLUX_CACHE)
    report = api.build(path)
    assert not report.failed, [o.error for o in report.failed]
    return path


def test_int8_first_block_caching_on_flux_is_built_and_parity_checked(built_flux, tmp_path):
    """FLUX's first_block / rest_blocks quantized beside the int8 transformer, the cached pipeline judged against
    the fp32 uncached reference."""
    run = api.parity(built_flux, targets=["onnxruntime"], out_dir=tmp_path / "parity")
    variants = {v.variant_id: v for v in run.report.variants}
    plain, cached = variants["flux-tiny/onnxruntime/64x64"], variants["flux-tiny/onnxruntime/64x64/step-cache"]
    assert plain.passed and cached.passed, plain.failure_reasons + cached.failure_reasons
    assert "c" in cached.step_schedule  # some steps skipped the remaining blocks
    # the looser of first_block's 30 dB / 0.90 and int8's 20 dB / 0.80
    assert (cached.thresholds.min_psnr_db, cached.thresholds.min_ssim) == (20.0, 0.80)
    engines = {c.component for c in plain.components}
    assert {"flux-tiny.first_block.64x64.b1.int8", "flux-tiny.rest_blocks.64x64.b1.int8"} <= engines


@pytest.mark.triton
def test_the_served_int8_first_block_pipeline_equals_the_in_process_one(built_flux, tmp_path):
    from trt_diffusion.triton import client as triton_client
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.client import ImageRequest

    config = load_engines_file(built_flux, check_sources=True)
    model_dir, family, table = engine_runners(config, FLUX_NAME, "onnxruntime")
    pipe = EnginePipeline(model_dir, family, table, step_cache=config.models[FLUX_NAME].step_cache)
    fields = _request(guidance_scale=3.5, steps=6)
    cached = pipe.generate(GenerationRequest(**fields, step_cache="on"))
    assert "c" in cached.timings.step_schedule
    assert not np.array_equal(cached.images[0], pipe.generate(GenerationRequest(**fields, step_cache="off")).images[0])
    stage.package_stage(built_flux, tmp_path / "repo")
    served, _ = stage.start(tmp_path / "repo", work_dir=tmp_path / "work", first_request=True)
    try:
        image = triton_client.generate_images(served.grpc_url, ImageRequest(**fields), protocol="grpc")[0][0]
    finally:
        served.stop()
    np.testing.assert_array_equal(image, cached.images[0])
