"""Which layers get quantizers: every Linear and Conv, minus the exclusion globs."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from ..families import Family
from .defaults import DEFAULT_EXCLUDE, FAMILY_EXCLUDE

QUANTIZABLE_TYPES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


@dataclass(frozen=True)
class LayerSelection:
    quantized: tuple[str, ...]
    excluded: dict[str, str]  # module name -> the pattern that kept it in higher precision
    patterns: tuple[str, ...]  # the effective pattern list (defaults + user, "!" re-includes)


def effective_patterns(user_patterns: list[str] | tuple[str, ...], family: Family | None = None) -> tuple[str, ...]:
    """The defaults, the family's own defaults (FAMILY_EXCLUDE), then engines.yaml's patterns."""
    family_defaults = FAMILY_EXCLUDE.get(Family(family), ()) if family is not None else ()
    return tuple(DEFAULT_EXCLUDE) + tuple(family_defaults) + tuple(user_patterns)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _first_match(name: str, patterns: list[str]) -> str | None:
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in _ancestors(name)):
            return pattern
    return None


def quantizable_layers(module: torch.nn.Module) -> list[str]:
    return [name for name, child in module.named_modules() if name and isinstance(child, QUANTIZABLE_TYPES)]


def select_layers(module: torch.nn.Module, user_patterns: list[str] | tuple[str, ...] = ()) -> LayerSelection:
    """Split the module's Linear/Conv layers into quantized and excluded.

    A pattern matches a layer's name or any ancestor's; "!pattern" in the user list re-includes layers
    the defaults would keep in higher precision.
    """
    patterns = effective_patterns(user_patterns)
    exclude = [p for p in patterns if not p.startswith("!")]
    include = [p[1:] for p in patterns if p.startswith("!")]
    quantized, excluded = [], {}
    for name in quantizable_layers(module):
        hit = _first_match(name, exclude)
        if hit is not None and _first_match(name, include) is None:
            excluded[name] = hit
        else:
            quantized.append(name)
    return LayerSelection(tuple(quantized), excluded, patterns)
