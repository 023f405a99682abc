"""What a build reports: one outcome per engine, and the targets this host skipped with the reason.

A target's failure is data, not a sentence to re-parse: `EngineOutcome.failure` is a `Failure`, `internal`
when it is a bug in trt-diffusion (the CLI exits 3 with its traceback) rather than bad input or a tool's
refusal (exit 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engines_file import EngineSpec


@dataclass(frozen=True)
class Failure:
    """Why one engine failed: data, not a sentence to re-parse. `internal` marks a bug in trt-diffusion
    (the CLI exits 3 with `traceback`) as opposed to bad input or a tool's refusal (exit 1)."""

    engine: str
    key: str
    message: str
    internal: bool = False
    traceback: str | None = None


@dataclass
class EngineOutcome:
    spec: EngineSpec
    path: Path | None
    cached: bool = False
    seconds: float = 0.0
    failure: Failure | None = None

    @property
    def error(self) -> str | None:
        return self.failure.message if self.failure else None

    @property
    def status(self) -> str:
        return "FAILED" if self.failure else ("CACHED" if self.cached else "BUILT")


@dataclass
class BuildReport:
    outcomes: list[EngineOutcome] = field(default_factory=list)
    skipped_targets: dict[str, str] = field(default_factory=dict)  # target -> why it was not built here

    @property
    def failed(self) -> list[EngineOutcome]:
        return [o for o in self.outcomes if o.failure]

    @property
    def internal_failures(self) -> list[EngineOutcome]:
        return [o for o in self.failed if o.failure.internal]

    @property
    def built(self) -> list[EngineOutcome]:
        return [o for o in self.outcomes if not o.failure and not o.cached]

    @property
    def cached(self) -> list[EngineOutcome]:
        return [o for o in self.outcomes if o.cached]
