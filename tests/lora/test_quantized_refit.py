"""`mode: refit` on int8/fp8 UNets (issue 17, acceptance 2): the LoRA refitted into the quantized onnxruntime
engine (weights and recomputed weight scales; calibrated activation scales kept, no recalibration) gives images
within the quantized parity bars of the fused-and-recalibrated variant of the same LoRA (`mode: fused`), and
closer to it than the base engine is. SmoothQuant engines refit with the delta smoothed like the weights.

The numbers and times: scripts/bench_quantized_refit.py (docs/lora.md). The parts without a second calibration
are tests/quantize/test_quantized_refit_scales.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from trt_diffusion.engines_file import EngineSpec, expand, load_engines_file
from trt_diffusion.errors import BuildError
from trt_diffusion.metrics import psnr, ssim, thresholds_for

PROMPTS = ["a lighthouse on a cliff at dusk", "a red bicycle leaning on a brick wall"]
ARGS = dict(height=64, width=64, steps=4, guidance_scale=5.0, seed=7)


def _config(path, model_dir, workspace, precision, mode, algorithm="max", targets=("onnxruntime",)):
    model = {"source": str(model_dir), "family": "sd15", "components": ["text_encoder", "unet", "vae_decoder"],
             "precision": {"text_encoder": "fp32", "unet": precision, "vae_decoder": "fp32"},
             "buckets": ["64x64"], "batch": [1], "targets": list(targets),
             "quantization": {"calibration": {"samples": 2, "steps": 2, "seed": 0, "algorithm": algorithm}},
             "loras": {"style": {"source": str(model_dir / "lora/pytorch_lora_weights.safetensors"), "mode": mode}}}
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": str(workspace)}, "models": {"m": model}}))
    return path


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_engines_yaml_takes_a_refit_lora_on_a_quantized_unet(tiny_sd15_dir, tmp_path, precision):
    config = load_engines_file(_config(tmp_path / "engines.yaml", tiny_sd15_dir, tmp_path / "build", precision,
                                       "refit"))
    unets = [s for s in expand(config) if s.component == "unet"]
    assert unets and all(s.refittable and s.lora_variant is None and s.precision == precision for s in unets)


def test_the_openvino_target_refuses_to_refit_a_quantized_engine(tmp_path):
    """OpenVINO folds the quantized weights and their scales into its own constants (measured: no int8 weight
    or scale keeps its name, no fp8 scale): refused before anything is converted, with what to do instead."""
    from trt_diffusion.engines_file import Bucket, Size
    from trt_diffusion.targets import get_target
    from trt_diffusion.targets.base import BuildRequest

    spec = EngineSpec(model="m", family="sd15", source="s", component="unet", target="openvino", precision="int8",
                      batch=2, bucket=Bucket.static(Size(64, 64)), refittable=True)
    request = BuildRequest(spec=spec, onnx_path=tmp_path / "missing.onnx", profile={}, workspace=tmp_path,
                           timing_cache_dir=tmp_path)
    with pytest.raises(BuildError, match=r"openvino target cannot refit int8 engines .*mode: fused"):
        get_target("openvino").build(request)


def _images(config, **kw):
    from trt_diffusion.runtime.loader import engine_runners
    from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest

    model_dir, family, table = engine_runners(config, "m", "onnxruntime", **kw)
    pipe = EnginePipeline(model_dir, family, table)
    return [pipe.generate(GenerationRequest(prompt=p, **ARGS)).images for p in PROMPTS]


def _worst(reference, candidate):
    return (min(psnr(r, c) for r, c in zip(reference, candidate)),
            min(ssim(r[0], c[0]) for r, c in zip(reference, candidate)))


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("precision,algorithm", [("int8", "max"), ("fp8", "max"), ("int8", "smoothquant")])
def test_refit_on_a_quantized_unet_matches_the_fused_recalibrated_variant(tiny_sd15_dir, tmp_path, precision,
                                                                          algorithm):
    from trt_diffusion import api

    workspace = tmp_path / "build"  # shared: the base UNet is calibrated once for both files
    refit_file = _config(tmp_path / "refit.yaml", tiny_sd15_dir, workspace, precision, "refit", algorithm)
    fused_file = _config(tmp_path / "fused.yaml", tiny_sd15_dir, workspace, precision, "fused", algorithm)
    for path in (refit_file, fused_file):
        report = api.build(path, target="onnxruntime")
        assert not report.failed, [o.failure.message for o in report.failed]
    refit_config, fused_config = load_engines_file(refit_file), load_engines_file(fused_file)
    lora = refit_config.models["m"].loras["style"].path

    base = _images(refit_config)
    refitted = _images(refit_config, loras=[(lora, 1.0)])
    fused = _images(fused_config, lora_variant="style")
    bar = thresholds_for(precision)
    refit_psnr, refit_ssim = _worst(fused, refitted)
    base_psnr, _ = _worst(fused, base)
    # measured (scripts/bench_quantized_refit.py): int8 35.8 dB / 0.993, fp8 29.6 / 0.969, smoothquant 32.6 / 0.984
    assert refit_psnr >= bar.min_psnr_db and refit_ssim >= bar.min_ssim, (refit_psnr, refit_ssim)
    assert refit_psnr > base_psnr + 2.0, (refit_psnr, base_psnr)  # the LoRA is there (base: 24-26 dB)

    # A -> base -> A on the quantized engine: bit for bit (every refit starts from the base weights)
    again = _images(refit_config, loras=[(lora, 1.0)])
    assert all(np.array_equal(a, b) for a, b in zip(refitted, again))
    assert all(np.array_equal(a, b) for a, b in zip(base, _images(refit_config)))
