"""Built sd15 tiny engines (onnxruntime target, with a ControlNet) shared by the Triton tests, built once per
session."""

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
def sd15_engines(tmp_path_factory, tiny_model_factory, write_engines_yaml) -> BuiltModel:
    """sd15 tiny at 64x64, batch 1, CFG batched (UNet batch 2): text encoder, UNet (with ControlNet residual
    inputs), ControlNet `canny`, VAE decoder."""
    from trt_diffusion import api
    from trt_diffusion.runtime.loader import built_engines
    from trt_diffusion.spec import load_engines_file

    model_dir = tiny_model_factory("sd15", controlnet=True)
    config_path = write_engines_yaml(tmp_path_factory.mktemp("triton-engines"), model_dir, "sd15", name="sd15-tiny",
                                     controlnets={"canny": {"source": str(model_dir / "controlnet")}})
    api.build(config_path, target="onnxruntime")
    config = load_engines_file(config_path, check_sources=True)
    return BuiltModel(config_path, "sd15-tiny", model_dir, "sd15", built_engines(config, "sd15-tiny", "onnxruntime"))
