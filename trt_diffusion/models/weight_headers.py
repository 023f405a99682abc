"""Parameter counts from `.safetensors` headers: the JSON at the start of each file names every tensor with
its dtype and shape, so a count needs neither torch nor the weights (`plan` answers in well under a second).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

from ..errors import ModelError

_FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header

# The header is read entry by entry against the format's own grammar (one regex match per tensor, nothing
# built but what is kept): a hostile header (a list, deep nesting, megabytes of `{}`) is refused at its first
# wrong byte, and memory stays within a small multiple of the header's size. json.loads would first build
# every object of it (a 20 MB header of `{}` cost 546 MB).
_STRING = rb'"(?:[^"\\\x00-\x1f]|\\.)*"'
_INTS = rb"\[\s*(?:\d+\s*(?:,\s*\d+\s*)*)?\]"
_FIELD = (rb'(?:"dtype"\s*:\s*"[A-Z0-9_]{1,16}"|"shape"\s*:\s*(?:' + _INTS
          + rb')|"data_offsets"\s*:\s*\[\s*\d+\s*,\s*\d+\s*\])')
_TENSOR = re.compile(rb"\s*(?P<NAME>" + _STRING + rb")\s*:\s*\{\s*(?P<FIELDS>" + _FIELD + rb"(?:\s*,\s*" + _FIELD
                     + rb"){2})\s*\}\s*(?P<END>[,}])")
_METADATA = re.compile(rb'\s*"__metadata__"\s*:\s*\{\s*(?:' + _STRING + rb"\s*:\s*" + _STRING + rb"\s*(?:,\s*"
                       + _STRING + rb"\s*:\s*" + _STRING + rb"\s*)*)?\}\s*(?P<END>[,}])")
_DTYPE = re.compile(rb'"dtype"\s*:\s*"([A-Z0-9_]{1,16})"')
_SHAPE = re.compile(rb'"shape"\s*:\s*(' + _INTS + rb")")


def _header_bytes(path: Path) -> bytes:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ModelError(f"{path}: not a .safetensors file ({size} bytes, shorter than its header)")
            length = int.from_bytes(prefix, "little")
            if length < 2 or length > min(_MAX_HEADER, size - 8):
                raise ModelError(f"{path}: not a .safetensors file (it declares a header of {length} bytes in a file "
                                 f"of {size})")
            return handle.read(length)
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc}") from None


def scan_header(path: Path) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of one .safetensors file, read from its header only; ModelError
    naming the file when the header is not a safetensors header."""
    import json

    header = _header_bytes(Path(path))
    position = len(header) - len(header.lstrip())
    if header[position:position + 1] != b"{":
        raise ModelError(f"{path}: not a .safetensors file (its header is not a JSON object of tensors)")
    position += 1
    if header[position:].strip() == b"}":
        return
    while True:
        metadata = _METADATA.match(header, position)
        match = metadata or _TENSOR.match(header, position)
        if match is None:
            raise ModelError(f"{path}: not a .safetensors file (its header is malformed at byte {8 + position})")
        if metadata is None:
            fields = match["FIELDS"]
            dtype, shape = _DTYPE.search(fields), _SHAPE.search(fields)
            if dtype is None or shape is None:
                raise ModelError(f"{path}: not a .safetensors file (a tensor entry at byte {8 + position} lacks its "
                                 "dtype or shape)")
            try:
                name = json.loads(match["NAME"])
            except ValueError:
                raise ModelError(f"{path}: not a .safetensors file (a tensor name at byte {8 + position})") from None
            dims = tuple(int(d) for d in shape.group(1).strip(b"[] \t\r\n").split(b",") if d.strip())
            yield name, dtype.group(1).decode(), dims
        position = match.end()
        if match["END"] == b"}":
            if header[position:].strip(b" \t\r\n"):
                raise ModelError(f"{path}: not a .safetensors file (bytes after its header's end)")
            return


def read_header(path: Path) -> dict[str, dict]:
    """The tensor table of one .safetensors file (name -> {dtype, shape})."""
    return {name: {"dtype": dtype, "shape": list(shape)} for name, dtype, shape in scan_header(path)}


def header_keys(path: Path) -> list[str]:
    """The tensor names of one .safetensors file, from its header (bounded in memory)."""
    return [name for name, _, _ in scan_header(path)]


def stored_parameter_count(folder: Path, prefixes: tuple[str, ...] | None = None) -> int | None:
    """Elements of the floating-point tensors saved in the folder's .safetensors files (only those whose name
    starts with one of `prefixes`, when given); None when the folder holds no .safetensors file."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        for name, dtype, shape in scan_header(file):
            if dtype in _FLOATING and (prefixes is None or name.startswith(prefixes)):
                total += math.prod(shape)
    return total
