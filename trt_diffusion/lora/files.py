"""Reading LoRA files: safetensors tensors plus the adapter metadata diffusers writes beside them.

Only reading and format detection live here; turning keys into module names is `naming.py`'s job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import torch

from ..errors import ModelError

DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
ADAPTER_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
KOHYA_PREFIXES = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", "lora_te3_", "lora_transformer_")


class LoraNaming(str, Enum):
    diffusers = "diffusers"  # diffusers/PEFT (`unet.x.to_q.lora_A.weight`), incl. the older attn-processor forms
    kohya = "kohya"  # kohya-ss / A1111 (`lora_unet_x_to_q.lora_down.weight` + `.alpha`)


@dataclass(frozen=True)
class LoraFile:
    """One LoRA file as stored: its tensors by original key, and diffusers' adapter metadata if any."""

    path: Path
    tensors: dict[str, torch.Tensor]
    naming: LoraNaming
    adapter_metadata: dict = field(default_factory=dict)
    """`lora_adapter_metadata` as written by diffusers: `unet.r`, `unet.lora_alpha`, `unet.alpha_pattern`, ..."""


def resolve_lora_path(path: str | Path) -> Path:
    """A LoRA file, or a folder holding diffusers' `pytorch_lora_weights.safetensors`."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / DIFFUSERS_WEIGHT_NAME] + sorted(path.glob("*.safetensors"))
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise ModelError(f"LoRA folder {path} holds no .safetensors file")
        return found
    if not path.is_file():
        raise ModelError(f"LoRA file {path} does not exist")
    if path.suffix != ".safetensors":
        # pickled .bin/.ckpt files can run code on load: refuse rather than unpickle
        raise ModelError(f"LoRA file {path}: only .safetensors files are read (got {path.suffix or 'no suffix'})")
    return path


def detect_naming(keys: list[str]) -> LoraNaming:
    if keys and all(key.startswith(KOHYA_PREFIXES) for key in keys):
        return LoraNaming.kohya
    return LoraNaming.diffusers


def read_lora_file(path: str | Path) -> LoraFile:
    from safetensors import SafetensorError, safe_open

    file = resolve_lora_path(path)
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelError(f"cannot read LoRA file {file}: {exc}") from None
    if not tensors:
        raise ModelError(f"LoRA file {file} holds no tensors")
    adapter_metadata: dict = {}
    if metadata.get(ADAPTER_METADATA_KEY):
        try:
            adapter_metadata = json.loads(metadata[ADAPTER_METADATA_KEY])
        except json.JSONDecodeError as exc:
            raise ModelError(f"LoRA file {file}: its {ADAPTER_METADATA_KEY} metadata is not JSON ({exc})") from None
    return LoraFile(path=file, tensors=tensors, naming=detect_naming(list(tensors)), adapter_metadata=adapter_metadata)
