"""The slow suite's scheduler names test files by path (tests/shared/slow_schedule.py): a renamed or moved file
would silently drop out of its unit. Every path it names exists, and each shared-build file uses its fixture (or one built over it)."""

from __future__ import annotations

from pathlib import Path

from slow_schedule import BUILT_OVER, RUN_FIRST, SHARED_BUILDS

ROOT = Path(__file__).resolve().parents[1]


def test_every_named_file_exists_and_uses_the_build_it_is_grouped_by():
    for path in RUN_FIRST:  # a file, or a unit of SHARED_BUILDS
        assert (ROOT / path).is_file() or path in SHARED_BUILDS.values(), path
    for path, unit in SHARED_BUILDS.items():
        text = (ROOT / path).read_text()
        assert any(fixture in text for fixture in BUILT_OVER.get(unit, (unit,))), (path, unit)
