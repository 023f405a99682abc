"""ModelOpt PTQ of the denoiser (FP8 / INT8) into gated Q/DQ ONNX: the only importer of modelopt.

Entry points (in `stage.py`): `quantize(config_path, model=None) -> QuantizeReport` and
`quantize_component(model, component, precision, lora_variant, workspace) -> QuantizedArtifact`.
Importing this package does not import modelopt or torch; see docs/quantize.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .stage import QuantizedArtifact, QuantizeReport, quantize, quantize_component

__all__ = ["QuantizeReport", "QuantizedArtifact", "quantize", "quantize_component"]


def __getattr__(name: str):
    if name in __all__:
        from . import stage

        return getattr(stage, name)
    raise AttributeError(name)
