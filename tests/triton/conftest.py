"""The built sd15 tiny engines the Triton tests serve: the session's shared build (tests/conftest.py
`built_sd15`: onnxruntime target, 64x64, CFG batched, a ControlNet), not a build of their own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml


@dataclass(frozen=True)
class BuiltModel:
    config_path: Path
    name: str
    model_dir: Path
    family: str
    engines: list  # BuiltEngine


@pytest.fixture(scope="session")
def sd15_engines(built_sd15) -> BuiltModel:
    """sd15 tiny at 64x64, batch 1, CFG batched (UNet batch 2): text encoder, UNet (with ControlNet residual
    inputs), ControlNet `canny`, VAE decoder. Read-only, like `built_sd15`."""
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import built_engines

    config = load_engines_file(built_sd15, check_sources=True)
    (name,) = config.models
    model = config.models[name]
    return BuiltModel(built_sd15, name, model.source.path, model.family.value, built_engines(config, name, "onnxruntime"))


QWEN_SIZE = 64  # the served Qwen-Image tests' bucket: 64x64
QWEN_TEXT_LENGTH = {"min": 2, "opt": 64, "max": 256}  # below diffusers' 512: the entry must truncate where they end


@pytest.fixture(scope="module")
def qwen_workspace(tiny_model_factory, tmp_path_factory) -> Path:
    """engines.yaml of the tiny Qwen-Image (model `qwen`) at 64x64, batch 1, `cfg: [split]` (true CFG as diffusers'
    two calls), fp32, `text_length` max 256, workflows txt2img, img2img and inpaint: its text encoder, transformer
    and VAE decoder and encoder built on onnxruntime (once per module, about 35 s on 2 cores)."""
    from trt_diffusion import api

    root = tmp_path_factory.mktemp("qwen")
    components = ["text_encoder", "transformer", "vae_decoder", "vae_encoder"]
    model = {"source": str(tiny_model_factory("qwen_image")), "family": "qwen_image",
             "buckets": [f"{QWEN_SIZE}x{QWEN_SIZE}"], "batch": [1], "cfg": ["split"], "targets": ["onnxruntime"],
             "components": components, "precision": {c: "fp32" for c in components},
             "text_length": QWEN_TEXT_LENGTH, "workflows": ["txt2img", "img2img", "inpaint"]}
    path = root / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": str(root / "build")},
                                    "models": {"qwen": model}}, sort_keys=False))
    report = api.build(path, target="onnxruntime")
    assert not report.failed, [o.error for o in report.failed]
    return path
