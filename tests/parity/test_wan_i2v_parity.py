"""Wan image-to-video engines against the torch reference (issue 24): the tiny Wan 2.1 I2V (CLIP image encoder) and
Wan 2.2 I2V A14B (two experts, no image encoder) checkpoints, built on onnxruntime and openvino, pass the fp32
parity gate per frame from the same seeded first frame: the img2vid variant of each target (its id ends in
/img2vid), the init image shown beside the clips, and every engine, image and VAE encoders included, within its
tensor tolerance. Slow: each checkpoint's engines are built for two targets (about two minutes per checkpoint)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import WAN_I2V_BUCKETS
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.parity.stage import ParityOptions, run_parity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TARGETS = ("onnxruntime", "openvino")


@pytest.mark.parametrize("variant", ["i2v", "i2v_two_expert"])
def test_i2v_engines_pass_parity_on_both_cpu_targets(built_wan_i2v, tmp_path, variant):
    for target in TARGETS:
        config = built_wan_i2v(variant, target)
    bucket = WAN_I2V_BUCKETS[variant]
    frames = int(bucket.split("x")[2])
    # 4 steps: Wan 2.2's boundary_ratio gives two to the high-noise expert and two to the low-noise one
    run = run_parity(load_engines_file(config, check_sources=True), tmp_path / "parity",
                     ParityOptions(prompts=("a red fox running through snow",), seeds=(0,), steps=4,
                                   compute_lpips=False))
    variants = {v.target: v for v in run.report.variants}
    assert set(variants) == set(TARGETS)  # img2vid only: an I2V checkpoint serves nothing else
    for target, result in variants.items():
        assert result.workflow == "img2vid" and result.variant_id == f"wan/{target}/{bucket}/img2vid"
        assert result.passed, (target, result.failure_reasons)
        (image,) = result.images
        assert image.video is not None and len(image.video.psnr_db) == frames
        assert image.init_png and (tmp_path / "parity" / image.init_png).is_file()
        compared = {diff.component.split(".")[1] for diff in result.components}
        expected = {"text_encoder", "transformer", "vae_encoder", "vae_decoder"}
        expected |= {"image_encoder"} if variant == "i2v" else {"transformer_2"}
        assert expected <= compared, compared
    saved = json.loads((tmp_path / "parity" / "parity.json").read_text())
    assert all(v["workflow"] == "img2vid" and v["images"][0]["video"] for v in saved["variants"])
