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
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..components import get_component, load_model_config
from ..errors import BuildError, TrtDiffusionError
from ..spec import EngineSpec, EnginesConfig

ProgressCallback = Callable[[str, EngineSpec | None], None]


@dataclass
class EngineOutcome:
    spec: EngineSpec
    path: Path | None
    cached: bool = False
    seconds: float = 0.0
    error: str | None = None


@dataclass
class BuildReport:
    outcomes: list[EngineOutcome] = field(default_factory=list)
    skipped_targets: dict[str, str] = field(default_factory=dict)  # target -> why it was not built here

    @property
    def failed(self) -> list[EngineOutcome]:
        return [o for o in self.outcomes if o.error]

    @property
    def built(self) -> list[EngineOutcome]:
        return [o for o in self.outcomes if not o.error and not o.cached]

    @property
    def cached(self) -> list[EngineOutcome]:
        return [o for o in self.outcomes if o.cached]


def available_targets() -> dict[str, str | None]:
    """target -> None when it can build here, else the reason it cannot."""
    from .tensorrt_target import tensorrt_available

    ok, reason = tensorrt_available()
    return {"onnxruntime": None, "tensorrt": None if ok else reason}


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
            held = budget.acquire(_memory_estimate(onnx_path))
            try:
                path, cached = _build_one(config, spec, onnx_path)
            finally:
                budget.release(held)
            outcome = EngineOutcome(spec, path, cached, time.perf_counter() - start)
        except TrtDiffusionError as exc:
            outcome = EngineOutcome(spec, None, error=str(exc), seconds=time.perf_counter() - start)
        except Exception as exc:  # the tool's own failure: keep the trace for the report
            detail = traceback.format_exception_only(type(exc), exc)[-1].strip()
            outcome = EngineOutcome(spec, None, error=detail, seconds=time.perf_counter() - start)
        progress("cached" if outcome.cached else ("failed" if outcome.error else "built"), spec)
        return outcome

    if jobs <= 1:
        return [one(spec) for spec in specs]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(one, spec): i for i, spec in enumerate(specs)}
        outcomes = [None] * len(specs)
        for future in as_completed(futures):
            outcomes[futures[future]] = future.result()
    return outcomes


def _memory_estimate(onnx_path: Path) -> int:
    """Building holds the weights about three times (graph, optimizer copy, output)."""
    data = sum(p.stat().st_size for p in Path(onnx_path).parent.glob("*") if p.is_file())
    return 3 * data


def profile_for(config: EnginesConfig, spec: EngineSpec):
    model = config.models[spec.model]
    cn_dir = model.controlnets[spec.controlnet].path if spec.controlnet else None
    model_config = load_model_config(model.source.path, model.family, spec.component, controlnet_dir=cn_dir)
    return get_component(model.family, spec.component).profile(spec, model_config)


def _build_one(config: EnginesConfig, spec: EngineSpec, onnx_path: Path) -> tuple[Path, bool]:
    profile = profile_for(config, spec)
    if spec.target == "onnxruntime":
        from . import onnxruntime_target

        add_refit_map = (lambda folder: _write_refit_map(config, spec, folder)) if spec.refittable else None
        folder, _, cached = onnxruntime_target.build_engine(onnx_path, spec, profile, config.workspace,
                                                            before_commit=add_refit_map)
        return folder, cached
    if spec.target == "tensorrt":
        from . import tensorrt_config as trt_config
        from . import tensorrt_target

        plan = trt_config.engine_path(config.workspace, spec)
        if _tensorrt_engine_current(plan, spec, onnx_path, profile):
            return plan, True
        refit_map = None
        if spec.refittable:  # TensorRT refits by ONNX initializer name: keep the map beside the plan
            from ..lora import build_refit_map

            refit_map = plan.with_name(plan.name.removesuffix(".plan") + ".refit_map.json")
            plan.parent.mkdir(parents=True, exist_ok=True)
            build_refit_map(onnx_path, base_denoiser(config, spec.model)).save(refit_map)
        tensorrt_target.build_engine(onnx_path, spec, profile, plan, config.timing_cache_dir,
                                     refit_map=str(refit_map) if refit_map else None)
        return plan, False
    raise BuildError(f"unknown target {spec.target!r}")


_module_lock = threading.Lock()
_denoisers: dict[str, object] = {}


def base_denoiser(config: EnginesConfig, model_name: str):
    """The denoiser's torch module with the base weights (loaded once per model): refit maps are built
    from it and LoRAs are fused against it."""
    from ..families import family_info
    from ..models.loading import load_component

    with _module_lock:
        if model_name not in _denoisers:
            model = config.models[model_name]
            _denoisers[model_name] = load_component(model.source.path, family_info(model.family).denoiser)
        return _denoisers[model_name]


def _write_refit_map(config: EnginesConfig, spec: EngineSpec, folder: Path) -> None:
    """Save, with a refittable engine, where each denoiser parameter lives among its initializers."""
    from ..lora import build_refit_map
    from .onnxruntime_target import MODEL_FILE

    build_refit_map(folder / MODEL_FILE, base_denoiser(config, spec.model)).save(folder)


def _tensorrt_engine_current(plan: Path, spec: EngineSpec, onnx_path: Path, profile) -> bool:
    """Reuse a plan only when its manifest records exactly these inputs on this TensorRT and GPU."""
    from . import tensorrt_config as trt_config
    from .tensorrt_target import host_info

    try:
        manifest = trt_config.EngineManifest.read(trt_config.manifest_path(plan))
    except Exception:  # missing or unreadable: build
        return False
    if not plan.is_file() or plan.stat().st_size != manifest.plan_bytes:
        return False
    trt_version, compute_capability, _ = host_info()
    flags = trt_config.BuildFlags.for_spec(spec, trt_config.onnx_has_qdq(onnx_path))
    return trt_config.manifest_is_current(manifest, spec, trt_config.onnx_sha256(onnx_path), flags, profile,
                                          trt_version, compute_capability)
