"""The built sd15 tiny engines the Triton tests serve: the session's shared build (tests/conftest.py
`built_sd15`: onnxruntime target, 64x64, CFG batched, a ControlNet), not a build of their own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest


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
