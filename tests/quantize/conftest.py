"""Fixtures for the quantize stage: engines.yaml files over the tiny seeded models, and quantized artifacts
built once per session (each takes seconds; several tests read the same one)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from trt_diffusion.engines_file import ResolvedModel, load_engines_file

# Small enough for CI, real enough to exercise CFG, the scheduler and several timesteps.
TINY_CALIBRATION = {"samples": 2, "steps": 2, "seed": 0}
TINY_BUCKET = {"sd15": "64x64", "sdxl": "64x64", "sd3": "128x128", "flux": "128x128"}
DENOISER = {"sd15": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer"}


def model_entry(model_dir: Path, family: str, precision: str, **extra) -> dict:
    denoiser = DENOISER[family]
    calibration = {**TINY_CALIBRATION, **extra.pop("calibration", {})}
    quantization = {"calibration": calibration, **extra.pop("quantization", {})}
    return {"source": str(model_dir), "family": family, "components": [denoiser],
            "precision": {denoiser: precision}, "buckets": [TINY_BUCKET[family]], "quantization": quantization,
            **extra}


@pytest.fixture
def write_config(tmp_path) -> Callable[..., Path]:
    """`write_config(models: dict, name="engines.yaml") -> Path` of an engines.yaml in tmp_path."""

    def write(models: dict, name: str = "engines.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build"}, "models": models}))
        return path

    return write


def resolved(config_path: Path, name: str) -> ResolvedModel:
    return load_engines_file(config_path).models[name]


@pytest.fixture(scope="session")
def quantized_matrix(tiny_model_factory, tmp_path_factory):
    """`quantized_matrix(family, precision) -> (ResolvedModel, QuantizedArtifact)`, built once per session."""
    from trt_diffusion.quantize.stage import quantize_component

    root = tmp_path_factory.mktemp("quantize-matrix")
    cache: dict[tuple[str, str], tuple] = {}

    def get(family: str, precision: str):
        key = (family, precision)
        if key not in cache:
            config = root / f"{family}-{precision}.yaml"
            config.write_text(yaml.safe_dump({"version": 1, "models": {
                "m": model_entry(tiny_model_factory(family), family, precision)}}))
            model = resolved(config, "m")
            artifact = quantize_component(model, DENOISER[family], precision, None, root / "build",
                                          held_out_samples=1)
            cache[key] = (model, artifact)
        return cache[key]

    return get
