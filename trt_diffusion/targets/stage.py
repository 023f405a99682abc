"""`build`: one engine per EngineSpec, for every target this machine can build.

Each engine is built from the ONNX its export group produced (the Q/DQ ONNX for fp8/int8 specs), with
the (min, opt, max) profile its component declaration derives from the spec. Engines whose inputs are
unchanged are reused; a failing engine is reported with its spec and the tool's error while the others
still build, and the stage fails at the end.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from ..components import get_component, load_model_config
from ..engines_file import EnginesConfig, EngineSpec
from ..errors import TrtDiffusionError
from . import get_target
from .base import BuildReport, BuildRequest, EngineOutcome, Failure  # noqa: F401  (BuildReport re-exported)

ProgressCallback = Callable[[str, EngineSpec | None], None]


class MemoryBudget:
    """Parallel builds share a memory budget: a job waits until its estimate fits (a job larger than the
    whole budget runs alone)."""

    def __init__(self, budget_bytes: int):
        self.budget, self.used = budget_bytes, 0
        self._cond = threading.Condition()

    def acquire(self, need: int) -> int:
        need = min(need, self.budget)
        with self._cond:
            self._cond.wait_for(lambda: self.used + need <= self.budget)
            self.used += need
        return need

    def release(self, amount: int) -> None:
        with self._cond:
            self.used -= amount
            self._cond.notify_all()


def build_specs(config: EnginesConfig, specs: list[EngineSpec], onnx_for: Callable[[EngineSpec], Path], *,
                jobs: int, progress: ProgressCallback | None = None) -> list[EngineOutcome]:
    progress = progress or (lambda message, spec: None)
    budget = MemoryBudget(int(config.build.memory_budget_gb * (1 << 30)))

    def one(spec: EngineSpec) -> EngineOutcome:
        start = time.perf_counter()
        try:
            onnx_path = onnx_for(spec)
            held = budget.acquire(memory_estimate(onnx_path))
            try:
                path, cached = build_one(config, spec, onnx_path)
            finally:
                budget.release(held)
            outcome = EngineOutcome(spec, path, cached, time.perf_counter() - start)
        except TrtDiffusionError as exc:  # bad input or a tool's refusal: the message says what to change
            outcome = EngineOutcome(spec, None, seconds=time.perf_counter() - start,
                                    failure=Failure(spec.name, spec.key, str(exc)))
        except Exception as exc:  # a bug: keep the traceback, the CLI exits 3 with it
            detail = traceback.format_exception_only(type(exc), exc)[-1].strip()
            outcome = EngineOutcome(spec, None, seconds=time.perf_counter() - start, failure=Failure(
                spec.name, spec.key, detail, internal=True, traceback=traceback.format_exc()))
        progress(outcome.status.lower(), spec)
        return outcome

    if jobs <= 1:
        return [one(spec) for spec in specs]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(one, spec): i for i, spec in enumerate(specs)}
        outcomes = [None] * len(specs)
        for future in as_completed(futures):
            outcomes[futures[future]] = future.result()
    return outcomes


def memory_estimate(onnx_path: Path) -> int:
    """Building holds the weights about three times (graph, optimizer copy, output)."""
    data = sum(p.stat().st_size for p in Path(onnx_path).parent.glob("*") if p.is_file())
    return 3 * data


def profile_for(config: EnginesConfig, spec: EngineSpec):
    model = config.models[spec.model]
    cn_dir = model.controlnets[spec.controlnet].path if spec.controlnet else None
    model_config = load_model_config(model.source.path, model.family, spec.component, controlnet_dir=cn_dir)
    return get_component(model.family, spec.component).profile(spec, model_config)


def build_one(config: EnginesConfig, spec: EngineSpec, onnx_path: Path) -> tuple[Path, bool]:
    """Build one engine holding its key's lock (threads, processes and hosts sharing the workspace build a
    key once: a waiter finds the engine current and reuses it), recording its provenance when built.

    With a URL workspace the store's lock of the key is held too; the engine is pulled first (another host's
    build is reused) and published after (workspace/store_sync.py)."""
    from ..workspace import store_sync
    from ..workspace.locks import clean_temporaries, engine_lock
    from ..workspace.provenance import record_provenance

    target = get_target(spec.target)
    request = build_request(config, spec, onnx_path)
    start = time.perf_counter()
    with engine_lock(config.workspace, spec.key), store_sync.engine_lock(config, spec.key):
        clean_temporaries(config.workspace, spec.name, spec.key)  # of builds killed before: the lock proves them dead
        store_sync.pull_engines(config, [spec.key])
        path, cached = target.build(request)
        if not cached:
            record_provenance(config.workspace, spec, path, time.perf_counter() - start)
        store_sync.publish_engine(config, spec, path)
    return path, cached


def build_request(config: EnginesConfig, spec: EngineSpec, onnx_path: Path) -> BuildRequest:
    writer = None
    if spec.refittable:
        def writer(onnx: Path, destination: Path) -> None:
            from ..lora import build_refit_map

            build_refit_map(onnx, base_module(config, spec.model, spec.component)).save(destination)

    return BuildRequest(spec=spec, onnx_path=Path(onnx_path), profile=profile_for(config, spec),
                        workspace=Path(config.workspace), timing_cache_dir=Path(config.timing_cache_dir),
                        write_refit_map=writer)


_module_lock = threading.Lock()
_modules: dict[tuple[str, str, str], object] = {}


def base_module(config: EnginesConfig, model_name: str, component: str):
    """A component's torch module with the base weights (loaded once per model and component): refit maps
    are built from it and LoRAs are fused against it (the denoiser, and the text encoders a LoRA changes)."""
    from ..families import Component
    from ..models.loading import load_component

    with _module_lock:
        source = config.models[model_name].source.path
        key = (model_name, str(source), Component(component).value)  # the same name may mean other weights
        if key not in _modules:
            _modules[key] = load_component(source, Component(component))
        return _modules[key]


def base_denoiser(config: EnginesConfig, model_name: str):
    """The denoiser's torch module with the base weights (see `base_module`)."""
    from ..families import family_info

    return base_module(config, model_name, family_info(config.models[model_name].family).denoiser.value)
