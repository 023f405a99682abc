"""The runner over one TensorRT plan (TensorRT and a GPU are needed only when it is created)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...runtime.runners import TensorSpec, check_feeds


class TensorRTRunner:
    """A TensorRT engine. Input checks come from the engine's manifest; `run_engine` checks shapes
    against its profile."""

    def __init__(self, plan_path: str | Path, *, name: str | None = None):
        from . import engine
        from .config import EngineManifest, manifest_path

        self.path = Path(plan_path)
        self.name = name or self.path.name
        self._run = engine.run_engine
        self._engine = engine.load_engine(self.path)
        manifest = EngineManifest.read(manifest_path(self.path))
        self.inputs = {t.name: TensorSpec(np.dtype(t.dtype), tuple(d if d >= 0 else None for d in t.shape))
                       for t in manifest.inputs}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feeds(self.name, self.inputs, feeds)
        return self._run(self._engine, feeds)
