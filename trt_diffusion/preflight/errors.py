"""Preflight's user error: a bad input (no baseline, a baseline of other engines, an unknown check name)."""

from __future__ import annotations

from ..errors import TrtDiffusionError


class PreflightError(TrtDiffusionError):
    """Preflight could not run as asked: one message, exit 1, nothing written."""
