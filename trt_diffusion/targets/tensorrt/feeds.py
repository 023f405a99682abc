"""Inputs at run time: names, dtypes and shapes checked against an engine's manifest and profiles, one error
listing every problem and what the engine expects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import RuntimeInputError
from ...onnx_facts import Shape
from ...tensors import TensorSpec
from .manifest import EngineManifest


def _expected_inputs(manifest: EngineManifest) -> str:
    lines = []
    for info in manifest.inputs:
        shapes = manifest.profile_shapes.get(info.name)
        if shapes and shapes[0] != shapes[2]:
            shape_text = f"{shapes[0]}..{shapes[2]}"
        else:
            shape_text = str(shapes[0] if shapes else info.shape)
        lines.append(f"{info.name}: {info.dtype} {shape_text}")
    return "\n  ".join(lines)


def _feed_problems(info: TensorSpec, feed: Any, shapes: tuple[Shape, Shape, Shape] | None) -> list[str]:
    problems = []
    try:
        dtype = np.dtype(feed.dtype).name
        shape = tuple(int(d) for d in feed.shape)
    except (AttributeError, TypeError):
        return [f"{info.name}: expected a numpy array, got {type(feed).__name__}"]
    if dtype != info.dtype:
        problems.append(f"{info.name}: dtype {dtype}, expected {info.dtype}")
    declared = tuple(d if isinstance(d, int) else -1 for d in info.shape)  # a manifest's: ints, -1 dynamic
    low, high = (shapes[0], shapes[2]) if shapes else (declared, declared)
    in_range = len(shape) == len(low) and all(lo <= d <= hi for d, lo, hi in zip(shape, low, high))
    if not in_range:
        problems.append(f"{info.name}: shape {shape} is outside the engine's profile {low}..{high}")
    return problems


def check_feeds(manifest: EngineManifest, feeds: Mapping[str, Any]) -> None:
    """Check names, dtypes and shapes against the engine's profile; one error lists every problem."""
    problems = []
    expected = [info.name for info in manifest.inputs]
    missing = [name for name in expected if name not in feeds]
    unexpected = [name for name in feeds if name not in expected]
    if missing:
        problems.append(f"missing input(s): {missing}")
    if unexpected:
        problems.append(f"unexpected input(s): {unexpected}")
    for info in manifest.inputs:
        if info.name in feeds:
            problems += _feed_problems(info, feeds[info.name], manifest.profile_shapes.get(info.name))
    if not problems and manifest.profiles:  # inside the envelope, but inside one of the profiles?
        from .layout import select_profile

        shapes = {name: tuple(int(d) for d in feeds[name].shape) for name in expected}
        if select_profile(manifest.profiles, shapes) is None:
            listed = "; ".join(f"profile {i}: " + ", ".join(f"{n} {lo}..{hi}" for n, (lo, _, hi) in prof.items())
                               for i, prof in enumerate(manifest.profiles))
            problems.append(f"shapes {shapes} fit none of the engine's {len(manifest.profiles)} profiles ({listed})")
    if problems:
        raise RuntimeInputError(
            f"inputs for engine {manifest.spec_name} do not match it:\n  "
            + "\n  ".join(problems)
            + f"\nexpected:\n  {_expected_inputs(manifest)}"
        )
