"""The tiny Z-Image's engines, built once for the slow files that run them (engines, parity, serving, LoRA refit)."""

from __future__ import annotations

import pytest

FP32 = {"text_encoder": "fp32", "transformer": "fp32", "vae_decoder": "fp32"}
TARGETS = ("onnxruntime", "openvino")
MODEL = "z_image"  # the family conformance run's entry (tests/conftest.py: family_workspace)


@pytest.fixture(scope="session")
def built_z_image(family_workspace):
    """(engines.yaml, build report): the tiny Z-Image (its folder with `lora/`) at 64x64, CFG batched, fp32, built on
    onnxruntime and openvino; LoRA A (`models tiny --lora`) declared for refit, so the LoRA file refits the same
    transformer engines the parity and serving files run. Over `family_workspace` (whose z_image entry is this
    folder): the exports and the text encoder and VAE engines are the conformance run's, the refittable transformer
    engines are this fixture's. Treat it as read-only."""
    from family_builds import families_engines_yaml

    from trt_diffusion import api
    from trt_diffusion.engines_file import load_engines_file

    folder = load_engines_file(family_workspace.path).models[MODEL].source.path
    lora_a = folder / "lora" / "pytorch_lora_weights.safetensors"
    directory = family_workspace.root / "z_image-lora"
    directory.mkdir(exist_ok=True)
    path = families_engines_yaml(family_workspace, directory / "engines.yaml", (MODEL,), targets=list(TARGETS),
                                 precision=FP32, loras={"a": {"source": str(lora_a), "mode": "refit"}})
    report = api.build(path)
    if report.failed:
        raise RuntimeError(f"fixture build failed: {[o.error for o in report.failed]}")
    return path, report
