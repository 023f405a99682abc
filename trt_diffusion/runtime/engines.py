"""Which runner serves a component at a given size and batch: routing a request to its bucket's engines."""

from __future__ import annotations

from dataclasses import dataclass

from ..engines_file.engine_spec import Bucket, Size
from ..errors import RuntimeInputError
from .runners import Runner

MAX_DYNAMIC_ROWS = 8  # requests' rows per denoiser call where the engine's batch is dynamic


@dataclass(frozen=True)
class RunnerEntry:
    component: str
    runner: Runner
    bucket: Bucket | None = None  # None: any size (text encoders, the torch reference)
    batch: int | None = None  # None: any batch
    controlnet: str | None = None


class RunnerTable:
    def __init__(self, entries: list[RunnerEntry] | None = None):
        self.entries: list[RunnerEntry] = list(entries or [])

    def add(self, component: str, runner: Runner, *, bucket: Bucket | None = None, batch: int | None = None,
            controlnet: str | None = None) -> None:
        self.entries.append(RunnerEntry(component, runner, bucket, batch, controlnet))

    def has(self, component: str, controlnet: str | None = None) -> bool:
        return any(e.component == component and e.controlnet == controlnet for e in self.entries)

    def batches(self, component: str, size: Size | None) -> set[int | None]:
        return {e.batch for e in self._covering(component, size, None)}

    def find(self, component: str, *, size: Size | None, batch: int, controlnet: str | None = None) -> Runner:
        candidates = self._covering(component, size, controlnet)
        if not candidates:
            supported = self.supported_sizes(component, controlnet)
            raise RuntimeInputError(
                f"no {component}{f' ({controlnet})' if controlnet else ''} engine covers {size}; "
                f"supported sizes: {', '.join(supported) or 'none built'}")
        for entry in candidates:
            if entry.batch in (None, batch):
                return entry.runner
        have = sorted(e.batch for e in candidates if e.batch is not None)
        raise RuntimeInputError(f"no {component} engine for batch {batch} at {size}; built batches: {have}")

    def supported_sizes(self, component: str, controlnet: str | None = None) -> list[str]:
        labels = [e.bucket.label for e in self.entries
                  if e.component == component and e.controlnet == controlnet and e.bucket is not None]
        return list(dict.fromkeys(labels))

    def _covering(self, component, size, controlnet) -> list[RunnerEntry]:
        # Static buckets first: an exact-shape engine beats a range engine that also covers the size.
        found = [e for e in self.entries if e.component == component and e.controlnet == controlnet
                 and (e.bucket is None or size is None or e.bucket.covers(size))]
        return sorted(found, key=lambda e: (e.bucket is None, not (e.bucket and e.bucket.is_static)))
