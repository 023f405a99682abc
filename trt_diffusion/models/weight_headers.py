"""Parameter counts from `.safetensors` headers: the JSON at the start of each file names every tensor with
its dtype and shape, so a count needs neither torch nor the weights (`plan` answers in well under a second).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

_FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


def read_header(path: Path) -> dict[str, dict]:
    """The tensor table of one .safetensors file (name -> {dtype, shape, data_offsets})."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > _MAX_HEADER:
            raise ValueError(f"{path}: safetensors header of {length} bytes")
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def stored_parameter_count(folder: Path, prefixes: tuple[str, ...] | None = None) -> int | None:
    """Elements of the floating-point tensors saved in the folder's .safetensors files (only those whose name
    starts with one of `prefixes`, when given); None when the folder holds no .safetensors file."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        for name, entry in read_header(file).items():
            if entry.get("dtype") in _FLOATING and (prefixes is None or name.startswith(prefixes)):
                total += math.prod(entry.get("shape", ()))
    return total
