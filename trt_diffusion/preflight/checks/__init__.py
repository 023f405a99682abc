"""The eight checks of the pre-launch checklist, in the order they run (checklist.CHECK_NAMES)."""

from __future__ import annotations

from importlib import import_module

from ...checklist import CHECK_NAMES
from .base import Check


def get_check(name: str) -> Check:
    return import_module(f"{__name__}.{name}").CHECK


def all_checks() -> list[Check]:
    return [get_check(name) for name in CHECK_NAMES]
