"""`build --shard I/N`: a deterministic part of the engine matrix, for CI matrices without a cluster.

An engine belongs to shard `int(key, 16) % N + 1`: the same engine lands in the same shard on every host
and run, whatever else the matrix holds, and keys (sha256 prefixes) spread evenly. N shards built into
one shared workspace make the whole matrix; a plain `build` afterwards verifies it and builds nothing.
"""

from __future__ import annotations

import re

from ..engines_file import EngineSpec
from ..errors import ConfigError


def parse_shard(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match:
        raise ConfigError(f"--shard {text!r}: expected I/N, e.g. 1/4")
    index, count = int(match[1]), int(match[2])
    if count < 1 or not 1 <= index <= count:
        raise ConfigError(f"--shard {text!r}: I must be between 1 and N (N >= 1)")
    return index, count


def shard_of(key: str, count: int) -> int:
    return int(key, 16) % count + 1


def shard_specs(specs: list[EngineSpec], index: int, count: int) -> list[EngineSpec]:
    if count < 1 or not 1 <= index <= count:
        raise ConfigError(f"shard {index}/{count}: I must be between 1 and N (N >= 1)")
    return [spec for spec in specs if shard_of(spec.key, count) == index]
