"""|reference - candidate| heatmaps of image pairs, and where they are written."""

from __future__ import annotations

from pathlib import PurePosixPath

import numpy as np

HEATMAP_GAIN = 8.0  # a heatmap pixel reaches full scale at |diff| >= 255 / 8 ~ 32 grey levels

# An inferno-like ramp: black -> purple -> red -> orange -> pale yellow.
_HEATMAP_STOPS = np.array([0.0, 0.25, 0.5, 0.75, 1.0])
_HEATMAP_COLORS = np.array(
    [[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164]], dtype=np.float64
)


def diff_heatmap(reference: np.ndarray, candidate: np.ndarray, gain: float = HEATMAP_GAIN) -> np.ndarray:
    """A uint8 HxWx3 picture of |reference - candidate| (worst channel), amplified by `gain`."""
    if reference.shape != candidate.shape:
        raise ValueError(f"shape mismatch: reference {reference.shape} vs candidate {candidate.shape}")
    diff = np.abs(reference.astype(np.float64) - candidate.astype(np.float64))
    if diff.ndim == 3:
        diff = diff.max(axis=-1)
    level = np.clip(np.nan_to_num(diff, nan=255.0) * gain / 255.0, 0.0, 1.0)
    channels = [np.interp(level, _HEATMAP_STOPS, _HEATMAP_COLORS[:, c]) for c in range(3)]
    return np.rint(np.stack(channels, axis=-1)).astype(np.uint8)


def diff_png_name(candidate_png: str) -> str:
    """The heatmap's file name: next to the candidate, `<candidate stem>.diff.png`."""
    path = PurePosixPath(candidate_png)
    return str(path.with_name(f"{path.stem}.diff.png"))
