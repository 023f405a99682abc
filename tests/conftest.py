"""Shared fixtures: tiny seeded model folders, written once per session through the real code path."""

from __future__ import annotations

from pathlib import Path

import pytest

from trt_diffusion.models.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """`tiny_model_factory(family, controlnet=False, lora=False) -> Path`, cached per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[tuple, Path] = {}

    def make(family: str, controlnet: bool = False, lora: bool = False) -> Path:
        key = (family, controlnet, lora)
        if key not in cache:
            name = f"{family}{'-cn' if controlnet else ''}{'-lora' if lora else ''}"
            cache[key] = write_tiny_model(root / name, family, controlnet=controlnet, lora=lora)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_sd15_dir(tiny_model_factory) -> Path:
    """An sd15 tiny model with a ControlNet (in controlnet/) and a LoRA (in lora/)."""
    return tiny_model_factory("sd15", controlnet=True, lora=True)
