"""Shared fixtures: tiny seeded model folders, written once per session through the real code path,
and engines.yaml files that point at them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from trt_diffusion.models.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """`tiny_model_factory(family, controlnet=False, lora=False, variant=None) -> Path`, cached per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[tuple, Path] = {}

    def make(family: str, controlnet: bool = False, lora: bool = False, variant: str | None = None) -> Path:
        key = (family, controlnet, lora, variant)
        if key not in cache:
            name = f"{family}{'-cn' if controlnet else ''}{'-lora' if lora else ''}{f'-{variant}' if variant else ''}"
            cache[key] = write_tiny_model(root / name, family, controlnet=controlnet, lora=lora, variant=variant)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory):
    """`tiny_model_dir(family, controlnet=False, lora=False) -> Path`: the same cached factory, by its usual name."""
    return tiny_model_factory


@pytest.fixture(scope="session")
def tiny_sd15_dir(tiny_model_factory) -> Path:
    """An sd15 tiny model with a ControlNet (in controlnet/) and a LoRA (in lora/)."""
    return tiny_model_factory("sd15", controlnet=True, lora=True)


@pytest.fixture(scope="session")
def write_engines_yaml():
    """`write_engines_yaml(directory, model_dir, family, name=None, workspace="build", **model_fields) -> Path`.

    Writes `<directory>/engines.yaml` with one model (named `<family>-tiny` unless given) built from
    `model_dir`, targeting onnxruntime at batch 1 and 64x64 unless `model_fields` say otherwise
    (components, buckets, precision, controlnets, loras, batch, cfg, targets...).
    """

    def write(directory: Path, model_dir: Path, family: str, name: str | None = None, workspace: str = "build",
              **model_fields: Any) -> Path:
        model = {"source": str(model_dir), "family": family, "buckets": ["64x64"], "batch": [1],
                 "targets": ["onnxruntime"], **model_fields}
        document = {"version": 1, "build": {"workspace": workspace}, "models": {name or f"{family}-tiny": model}}
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "engines.yaml"
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path

    return write


@pytest.fixture(scope="session")
def built_sd15(tmp_path_factory, tiny_sd15_dir, write_engines_yaml) -> Path:
    """engines.yaml of the tiny sd15 model (64x64, CFG batched, a ControlNet, a refit LoRA) with every
    onnxruntime engine built. Shared by the build, parity and Triton tests; treat it as read-only."""
    from trt_diffusion import api

    config = write_engines_yaml(
        tmp_path_factory.mktemp("built-sd15"), tiny_sd15_dir, "sd15",
        precision={"text_encoder": "fp32", "unet": "fp32", "vae_decoder": "fp32"},
        controlnets={"canny": {"source": str(tiny_sd15_dir / "controlnet")}},
        loras={"style": {"source": str(tiny_sd15_dir / "lora/pytorch_lora_weights.safetensors"), "mode": "refit"}},
    )
    report = api.build(config, target="onnxruntime")
    if report.failed:
        raise RuntimeError(f"fixture build failed: {[o.error for o in report.failed]}")
    return config


@pytest.fixture(scope="session")
def built_sd15_workflows(tmp_path_factory, tiny_sd15_dir, write_engines_yaml) -> Path:
    """engines.yaml of the tiny sd15 model declaring txt2img, img2img and inpaint (so a VAE encoder engine too),
    fp32, a refit LoRA, with every onnxruntime and openvino engine built. Shared by the workflow parity, preflight
    and Triton tests; treat it as read-only."""
    from trt_diffusion import api

    config = write_engines_yaml(
        tmp_path_factory.mktemp("built-sd15-workflows"), tiny_sd15_dir, "sd15",
        workflows=["txt2img", "img2img", "inpaint"], targets=["onnxruntime", "openvino"],
        precision={"text_encoder": "fp32", "unet": "fp32", "vae_decoder": "fp32"},
        loras={"style": {"source": str(tiny_sd15_dir / "lora/pytorch_lora_weights.safetensors"), "mode": "refit"}},
    )
    report = api.build(config)
    if report.failed:
        raise RuntimeError(f"fixture build failed: {[o.error for o in report.failed]}")
    return config


# Helpers shared by several test folders (the target conformance suite) live in tests/shared/.
sys.path.insert(0, str(Path(__file__).parent / "shared"))
