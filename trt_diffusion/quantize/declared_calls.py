"""A family's own reading of its pipeline's denoiser calls, where the declaration names one (`FamilyInfo.
quantize_calls`, "module:Class", imported on first use): the quantize stage's generic mapping reads keyword tensors,
and a pipeline that passes its denoiser lists (Z-Image) says instead how its calls map onto the engine's inputs,
how the engine's output goes back, and what its legacy trace needs."""

from __future__ import annotations

import importlib

from ..families import Family, family_info


def declared_calls(family: Family | str):
    """The declaration's `quantize_calls` class; None: the generic mapping."""
    locator = family_info(family).quantize_calls
    if locator is None:
        return None
    module, _, name = locator.partition(":")
    return getattr(importlib.import_module(module), name)
