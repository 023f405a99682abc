"""Wan video engines against the torch reference (issue 24, acceptance 1): tiny Wan 2.1 and the Wan 2.2 two-expert
form built on onnxruntime and openvino pass the fp32 parity gate per frame (worst frame, mean, and the motion
check): Wan 2.1 at 5 frames with CFG split (WanPipeline's two calls), Wan 2.2 at 9 frames, not square, with CFG
batched (one batch-2 call). Slow: each builds its model's engines (about two minutes per model; Wan 2.1's exports
are the family conformance run's, over the session's family_workspace)."""

from __future__ import annotations

import json

import pytest

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.parity.stage import ParityOptions, run_parity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

FP32 = {"text_encoder": "fp32", "transformer": "fp32", "transformer_2": "fp32", "vae_decoder": "fp32"}


@pytest.mark.parametrize("variant, cfg, bucket", [(None, "split", "32x32x5"), ("two_expert", "batched", "48x32x9")])
def test_wan_engines_pass_parity_on_both_cpu_targets(tiny_model_factory, write_engines_yaml, family_workspace,
                                                     tmp_path, variant, cfg, bucket):
    targets = ["onnxruntime", "openvino"]
    if variant is None:  # Wan 2.1 is the family's tiny folder: over family_workspace, its exports are built once
        from family_builds import families_engines_yaml

        config = families_engines_yaml(family_workspace, tmp_path / "engines.yaml", ("wan",), buckets=[bucket],
                                       batch=[1], cfg=[cfg], targets=targets,
                                       precision={c: p for c, p in FP32.items() if c != "transformer_2"})
    else:
        config = write_engines_yaml(tmp_path, tiny_model_factory("wan", variant=variant), "wan",
                                    buckets=[bucket], cfg=[cfg], targets=targets, precision=FP32)
    report = api.build(config)
    assert not report.failed, [o.error for o in report.failed]
    # 4 steps: with boundary_ratio 0.875 two of them run the high-noise expert and two the low-noise one
    run = run_parity(load_engines_file(config, check_sources=True), tmp_path / "parity",
                     ParityOptions(prompts=("a red fox running through snow",), seeds=(0,), steps=4,
                                   compute_lpips=False))
    variants = {(v.target, v.bucket): v for v in run.report.variants}
    assert set(variants) == {(t, bucket) for t in ("onnxruntime", "openvino")}
    for key, result in variants.items():
        assert result.passed, (key, result.failure_reasons)
        (image,) = result.images
        assert image.video is not None and len(image.video.psnr_db) == int(key[1].split("x")[2])
    saved = json.loads((tmp_path / "parity" / "parity.json").read_text())
    assert all(v["images"][0]["video"] for v in saved["variants"])
