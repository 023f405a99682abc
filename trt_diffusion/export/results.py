"""What an export gives: one result per group and the report over them, and the progress events.

Apart from stage.py (which imports torch) so that a no-op export (export_state.py) answers without importing
torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..engines_file.engine_spec import EngineSpec
from ..workspace.store import Artifact
from .grouping import ExportGroup


@dataclass(frozen=True)
class ExportEvent:
    """Progress of one group: stage is hashing, reference, exporting, cleaning, parity, cached or done."""

    group: ExportGroup
    stage: str
    index: int
    total: int
    result: ExportResult | None = None


ProgressCallback = Callable[[ExportEvent], None]


@dataclass(frozen=True)
class ExportResult:
    group: ExportGroup
    artifact: Artifact
    cached: bool
    seconds: float

    @property
    def onnx_path(self) -> Path:
        return self.artifact.file(self.artifact.manifest["onnx"])

    @property
    def parity(self) -> list[dict]:
        return self.artifact.manifest["parity"]["checks"]

    @property
    def max_rel_error(self) -> float | None:
        values = [c["max_rel"] for c in self.parity if c.get("max_rel") is not None]
        return max(values) if values else None

    @property
    def dynamic_ranges(self) -> dict[str, list[int]]:
        return self.artifact.manifest["dynamic_ranges"]

    @property
    def shapes_label(self) -> str:
        return self.artifact.manifest["shapes"]["label"]

    @property
    def specs(self) -> tuple[EngineSpec, ...]:
        return self.group.specs


@dataclass(frozen=True)
class ExportReport:
    results: list[ExportResult] = field(default_factory=list)

    @property
    def by_spec(self) -> dict[str, ExportResult]:
        """EngineSpec key -> the export its engine is built from."""
        return {spec.key: result for result in self.results for spec in result.specs}

    def artifact_for(self, spec: EngineSpec) -> Path:
        """The ONNX file `spec`'s engine is built from."""
        return self.by_spec[spec.key].onnx_path
