"""The tiny Z-Image's engines, built once for the slow files that run them (engines, parity, serving, LoRA refit)."""

from __future__ import annotations

import pytest
import yaml

FP32 = {"text_encoder": "fp32", "transformer": "fp32", "vae_decoder": "fp32"}
TARGETS = ("onnxruntime", "openvino")
MODEL = "z_image-tiny"


@pytest.fixture(scope="session")
def built_z_image(tiny_model_factory, tmp_path_factory):
    """(engines.yaml, build report): the tiny Z-Image (its folder with `lora/`) at 64x64, CFG batched, fp32, built on
    onnxruntime and openvino; LoRA A (`models tiny --lora`) declared for refit, so the LoRA file refits the same
    transformer engines the parity and serving files run. One export and six builds; treat it as read-only."""
    from trt_diffusion import api

    folder = tiny_model_factory("z_image", lora=True)
    lora_a = folder / "lora" / "pytorch_lora_weights.safetensors"
    models = {MODEL: {"source": str(folder), "family": "z_image", "buckets": ["64x64"], "targets": list(TARGETS),
                      "precision": dict(FP32), "loras": {"a": {"source": str(lora_a), "mode": "refit"}}}}
    path = tmp_path_factory.mktemp("built-z_image") / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build"}, "models": models}))
    report = api.build(path)
    if report.failed:
        raise RuntimeError(f"fixture build failed: {[o.error for o in report.failed]}")
    return path, report
