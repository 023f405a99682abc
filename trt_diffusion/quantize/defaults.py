"""What is quantized by default, and the quality bars a quantized denoiser must clear.

Pure data: no torch, no modelopt.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ..families import FAMILIES, Family
from ..precision import Precision

# Module-name globs kept in higher precision unless engines.yaml re-includes them with "!pattern".
# A pattern matches a module or any of its ancestors ("time_embedding" covers time_embedding.linear_1).
# The list follows ModelOpt's diffusers example, plus the adaptive-norm modulation linears.
DEFAULT_EXCLUDE: tuple[str, ...] = (
    # first and last layers: few FLOPs, and rounding there lands straight on the input or the output
    "conv_in", "conv_out", "proj_out", "norm_out",
    # time and condition embeddings: one vector per sample, so nothing to gain and scale-sensitive
    "time_embedding", "*time_emb_proj", "add_embedding", "time_text_embed", "context_embedder", "x_embedder",
    "pos_embed",
    # residual 1x1 shortcuts (ModelOpt's diffusers example keeps them too)
    "*conv_shortcut",
    # adaptive-norm modulation (DiT norm1.linear, FLUX norm.linear): per-sample vectors, like embeddings
    "*norm*",
)

# Added for one family only (an image family's patterns, and so its calibration keys, stay as they were): each
# family's declaration lists them (families/<name>.py `quantize_exclude`).
FAMILY_EXCLUDE: Mapping[Family, tuple[str, ...]] = MappingProxyType(
    {family: info.quantize_exclude for family, info in FAMILIES.items() if info.quantize_exclude})

# SmoothQuant's migration strength (0: all on weights, 1: all on activations); TensorRT's diffusion demo
# uses 0.8 for its UNets.
SMOOTHQUANT_ALPHA = 0.8
# The "percentile" algorithm clips activation ranges at this percentile of the observed |values|.
CALIBRATION_PERCENTILE = 99.99

# Worst held-out denoiser output PSNR (dB, against the fp32 torch module; peak = the reference's range).
# Set between what broken and sound quantizations measure on the tiny seeded models (random weights; the
# figures are in docs/quantize.md): a calibration whose ranges are off by 1e4 or 1e-3 (every quantized layer
# destroyed) measures 16.3 dB on the tiny UNet, a sound one 33-40 dB. Real checkpoints quantize better than
# random weights, so these bars catch garbage without failing a usable engine; the image bar (engines.yaml
# `parity:`) is the one to tighten per model.
DENOISER_MIN_PSNR_DB: Mapping[str, float] = MappingProxyType({Precision.int8: 22.0, Precision.fp8: 20.0})

# Held-out samples the gate generates (each runs the calibration's step count).
HELD_OUT_SAMPLES = 2
HELD_OUT_SEED_OFFSET = 1_000_003  # far from any calibration seed
