"""Reading LoRA files: safetensors tensors plus the adapter metadata diffusers writes beside them.

Only reading and format detection live here; turning keys into module names is `naming.py`'s job.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import torch

from ..errors import ModelError
from .wan_naming import WAN_ORIGINAL, wan_form

DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
ADAPTER_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
KOHYA_PREFIXES = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", "lora_te3_", "lora_transformer_")


class LoraNaming(str, Enum):
    diffusers = "diffusers"  # diffusers/PEFT (`unet.x.to_q.lora_A.weight`), incl. the older attn-processor forms
    kohya = "kohya"  # kohya-ss / A1111 (`lora_unet_x_to_q.lora_down.weight` + `.alpha`), musubi-tuner's Wan LoRAs
    wan = "wan"  # the original Wan module names (`diffusion_model.blocks.0.self_attn.q.lora_A.weight`): wan_naming.py


@dataclass(frozen=True)
class LoraFile:
    """One LoRA file as stored: its tensors by original key, and diffusers' adapter metadata if any."""

    path: Path
    tensors: dict[str, torch.Tensor]
    naming: LoraNaming
    adapter_metadata: dict = field(default_factory=dict)
    """`lora_adapter_metadata` as written by diffusers: `unet.r`, `unet.lora_alpha`, `unet.alpha_pattern`, ..."""
    into_transformer_2: bool = False
    """Wan 2.2's two experts: the file's transformer part goes into `transformer_2` (the low-noise expert), as
    diffusers' `load_lora_weights(..., load_into_transformer_2=True)`; by default it goes into `transformer`."""


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
    if wan_form(keys) is WAN_ORIGINAL:
        return LoraNaming.wan
    return LoraNaming.diffusers


def read_lora_file(path: str | Path, *, into_transformer_2: bool = False) -> LoraFile:
    """The file's tensors and adapter metadata. `into_transformer_2`: its transformer part is for Wan 2.2's
    low-noise expert (diffusers' `load_into_transformer_2=True`)."""
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
    _check_tensors(file, tensors)
    adapter_metadata: dict = {}
    if metadata.get(ADAPTER_METADATA_KEY):
        text = metadata[ADAPTER_METADATA_KEY]
        if len(text) > _MAX_METADATA:
            raise ModelError(f"LoRA file {file}: its {ADAPTER_METADATA_KEY} metadata is {len(text)} characters; "
                             "that is not adapter metadata")
        try:
            adapter_metadata = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ModelError(f"LoRA file {file}: its {ADAPTER_METADATA_KEY} metadata is not JSON ({reason})") from None
        _check_metadata(file, adapter_metadata)
    return LoraFile(path=file, tensors=tensors, naming=detect_naming(list(tensors)), adapter_metadata=adapter_metadata,
                    into_transformer_2=bool(into_transformer_2))


_MAX_METADATA = 1 << 20
_NUMBER_FIELDS = ("r", "lora_alpha")
_PATTERN_FIELDS = ("rank_pattern", "alpha_pattern")


def _is_number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _check_tensors(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """ModelError naming the key for a tensor no LoRA holds: an alpha that is not one finite number, an empty
    (rank 0) weight, non-finite values (they would make every refitted weight non-finite)."""
    for key, tensor in tensors.items():
        if key.endswith(".alpha"):
            if tensor.numel() != 1:
                raise ModelError(f"LoRA file {file}: {key} holds {tensor.numel()} values; an alpha is one number")
            if not math.isfinite(float(tensor.reshape(()).double())):
                raise ModelError(f"LoRA file {file}: {key} is {float(tensor.reshape(()).double())}; an alpha must be "
                                 "a finite number")
            continue
        if tensor.numel() == 0:
            raise ModelError(f"LoRA file {file}: {key} is empty (shape {list(tensor.shape)}): a LoRA of rank 0 "
                             "changes nothing and its scaling alpha / rank is undefined")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ModelError(f"LoRA file {file}: {key} holds non-finite values (inf or NaN)")


def _check_metadata(file: Path, metadata) -> None:
    """ModelError naming the field for adapter metadata of the wrong shape (diffusers writes a JSON object of
    PEFT LoraConfig fields, optionally scoped `unet.lora_alpha`)."""
    where = f"LoRA file {file}: its {ADAPTER_METADATA_KEY} metadata"
    if not isinstance(metadata, dict):
        raise ModelError(f"{where} is a JSON {type(metadata).__name__}, not an object of adapter settings")
    for key, value in metadata.items():
        field = key.rsplit(".", 1)[-1]
        if field in _NUMBER_FIELDS and not (_is_number(value) and value >= 0):
            raise ModelError(f"{where}: {key} is {value!r}, not a finite non-negative number")
        if field == "r" and value == 0:
            raise ModelError(f"{where}: {key} is 0; a LoRA has rank 1 or more")
        if field in _PATTERN_FIELDS:
            if not isinstance(value, dict) or not all(isinstance(k, str) and _is_number(v) for k, v in value.items()):
                raise ModelError(f"{where}: {key} is not an object of module patterns to finite numbers")
        if field == "use_rslora" and not isinstance(value, bool):
            raise ModelError(f"{where}: {key} is {value!r}, not true or false")
