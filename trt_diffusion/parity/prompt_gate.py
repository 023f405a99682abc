"""Parity's "still draws the prompt" gate (issue 43): for a model whose folder declares the synthetic world (the
trained micro-models), the prompt-following figures of the engine's images against the fp32 reference's, each
aspect within a margin; for any other model, not applicable."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..models.micro import draws_synthetic_world
from ..prompt_following import grid_figures
from ..synthetic_world import prompt_grid
from .report.model import PromptFollowing

MARGIN_POINTS = 5.0  # an engine may read this many points below its fp32 reference, per aspect


def parity_prompts(model_dir: Path, default: Sequence[str]) -> tuple[str, ...]:
    """The prompts a model is compared on when the user chose none: the synthetic world's fixed grid for a model
    that draws it, else `default`."""
    return tuple(prompt_grid()) if draws_synthetic_world(model_dir) else tuple(default)


def judge_prompt_following(model_dir: Path, prompts: Sequence[str], reference: Sequence[np.ndarray],
                           engine: Sequence[np.ndarray], margin: float = MARGIN_POINTS
                           ) -> tuple[PromptFollowing | None, list[str]]:
    """(the figures, failure reasons); (None, []) where the gate does not apply: a model that does not declare
    the synthetic world, a prompt outside it, or video."""
    if not draws_synthetic_world(model_dir) or not reference or any(np.ndim(image) != 3 for image in reference):
        return None, []
    expected, got = grid_figures(reference, prompts), grid_figures(engine, prompts)
    if expected is None or got is None:
        return None, []
    failures = [f"prompt following: {aspect} {got[aspect]:.1f} % of images, {expected[aspect] - got[aspect]:.1f} "
                f"points below the reference's {expected[aspect]:.1f} % (margin {margin:g})"
                for aspect in expected if got[aspect] < expected[aspect] - margin]
    return PromptFollowing(reference=expected, engine=got, margin=margin, images=len(prompts)), failures
