"""Exports shared by the export tests: each group is exported once per session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from trt_diffusion import api
from trt_diffusion.export import ExportReport


def _sd15_main_fields(model_dir: Path) -> dict:
    """sd15: text encoder (fp16), UNet with ControlNet residual inputs, the ControlNet, VAE encoder and decoder,
    two buckets, two targets (one ONNX per component all the same)."""
    return dict(
        components=["text_encoder", "unet", "vae_encoder", "vae_decoder"],
        buckets=["64x64", "128x128"],
        targets=["tensorrt", "onnxruntime"],
        precision={"text_encoder": "fp16", "unet": "fp32", "vae_encoder": "fp32", "vae_decoder": "fp32"},
        controlnets={"canny": {"source": str(model_dir / "controlnet")}},
    )


@pytest.fixture(scope="session")
def sd15_main_fields():
    """`sd15_main_fields(model_dir) -> dict`: the engines.yaml model fields of `sd15_export`."""
    return _sd15_main_fields


@dataclass
class ExportRun:
    config: Path
    report: ExportReport

    def result(self, name_part: str):
        matches = [r for r in self.report.results if name_part in r.group.name]
        if len(matches) != 1:
            raise LookupError(f"{name_part!r} matches {[r.group.name for r in matches]}")
        return matches[0]


@pytest.fixture(scope="session")
def sd15_export(tmp_path_factory, tiny_model_dir, write_engines_yaml) -> ExportRun:
    model = tiny_model_dir("sd15", controlnet=True)
    config = write_engines_yaml(tmp_path_factory.mktemp("sd15-main"), model, "sd15", **_sd15_main_fields(model))
    return ExportRun(config, api.export(config))
