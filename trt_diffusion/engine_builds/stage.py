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

from ..engines_file import EnginesConfig, EngineSpec
from ..errors import TrtDiffusionError
from ..targets import BuildRequest, get_target
from .report import BuildReport, EngineOutcome, Failure

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
        except Exception as exc:  # noqa: BLE001 - a bug: keep the traceback, the CLI exits 3 with it
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


def build_engines(config: EnginesConfig, selected: list[EngineSpec], *,
                  prepare: Callable[[EnginesConfig, list[EngineSpec]], Callable[[EngineSpec], Path]],
                  target: str | None = None, narrowed: bool = False, jobs: int | None = None,
                  shard: tuple[int, int] | None = None, ray: str | None = None,
                  progress: ProgressCallback | None = None) -> BuildReport:
    """The build of `selected` (engines.yaml's specs, `narrowed` by --model/--component) on this host.

    `target` (--target) must be buildable here and asked for; other targets this host cannot build, and
    specs only other hosts build, are skipped with the reason (a build that is left with nothing fails).
    `shard=(i, n)` keeps the i-th of n parts; an unchanged build answers from build_state; otherwise
    `prepare(config, specs)` exports (and quantizes) what the engines are built from and gives each spec's
    ONNX, and the engines are built locally (`jobs` at a time) or on a Ray cluster (`ray`)."""
    from ..errors import ConfigError, MissingDependencyError
    from ..targets import check_target_name
    from . import build_state

    if target is not None:
        reason = get_target(check_target_name(target)).unavailable_reason()
        if reason is not None:
            raise MissingDependencyError(f"cannot build the {target} target on this machine: {reason}")
        if not any(s.target == target for s in selected):
            listed = ", ".join(dict.fromkeys(s.target for s in selected))
            raise ConfigError(f"--target {target}: {config.path} asks for no {target} engines"
                              f"{' of the selected models/components' if narrowed else ''} "
                              f"(its targets: {listed}); add {target} to `targets:` to build them")
    wanted = [s for s in selected if target is None or s.target == target]
    report = BuildReport()
    for name in dict.fromkeys(s.target for s in wanted):
        reason = get_target(name).unavailable_reason()
        if reason is not None:
            report.skipped_targets[name] = reason
    wanted = [s for s in wanted if s.target not in report.skipped_targets]
    wanted = _without_specs_for_other_hosts(wanted, report.skipped_targets)
    if not wanted and report.skipped_targets:  # a build that builds nothing says so, and fails
        reasons = "; ".join(f"{name}: {reason}" for name, reason in report.skipped_targets.items())
        raise MissingDependencyError(f"nothing to build on this machine: every engine {config.path} asks for is "
                                     f"for a target this machine cannot build ({reasons})")
    if shard is not None:
        from .shards import shard_specs

        wanted = shard_specs(wanted, *shard)
    unchanged = build_state.unchanged_report(config, wanted, report.skipped_targets)
    if unchanged is not None:  # nothing it was made from, nor anything it wrote, has changed
        return unchanged
    if wanted and ray is not None:
        from ..export import group_specs
        from .ray_executor import build_on_ray

        report.outcomes = build_on_ray(config, wanted, address=ray, prepare=prepare, progress=progress,
                                       groups=[group.specs for group in group_specs(wanted)])
    elif wanted:
        report.outcomes = build_specs(config, wanted, prepare(config, wanted), jobs=jobs or config.build.jobs,
                                      progress=progress)
    build_state.record(config, report)
    return report


def _without_specs_for_other_hosts(specs: list[EngineSpec], skipped: dict[str, str]) -> list[EngineSpec]:
    """Drop the specs a target builds only on other hosts (a plan for another GPU architecture), saying why."""
    kept = []
    for spec in specs:
        reason = get_target(spec.target).spec_unavailable_reason(spec)
        if reason is None:
            kept.append(spec)
        else:
            skipped[f"{spec.target} {spec.option('architecture') or spec.name}"] = reason
    return kept


def memory_estimate(onnx_path: Path) -> int:
    """Building holds the weights about three times (graph, optimizer copy, output)."""
    data = sum(p.stat().st_size for p in Path(onnx_path).parent.glob("*") if p.is_file())
    return 3 * data


def profile_for(config: EnginesConfig, spec: EngineSpec):
    from ..components import get_component, load_model_config  # torch: not for a no-op build

    model = config.models[spec.model]
    cn_dir = model.controlnets[spec.controlnet].path if spec.controlnet else None
    model_config = load_model_config(model.source.path, model.family, spec.component, controlnet_dir=cn_dir)
    return get_component(model.family, spec.component, spec.piece).profile(spec, model_config)


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

            module = base_module(config, spec.model, spec.component)
            unused = piece_unused_parameters(config, spec, module) if spec.piece else frozenset()
            build_refit_map(onnx, module, unused=unused).save(destination)

    # a spec with several profiles (engine_layout: profiles): one (min, opt, max) set per member shape, in order
    first, *rest = spec.members
    return BuildRequest(spec=spec, onnx_path=Path(onnx_path), profile=profile_for(config, first),
                        workspace=Path(config.workspace), timing_cache_dir=Path(config.timing_cache_dir),
                        write_refit_map=writer, extra_profiles=tuple(profile_for(config, m) for m in rest))


_module_lock = threading.Lock()
_modules: dict[tuple[str, str, str], object] = {}


def piece_unused_parameters(config: EnginesConfig, spec: EngineSpec, module) -> frozenset[str]:
    """The parameters of the denoiser a step cache's piece never reads (a shallow path holds a fraction of the
    UNet): found by running the piece's graph once in torch and noting the modules it calls. Its refit map lists
    them as unused, so a LoRA refit of the piece leaves them out instead of refusing them."""
    import torch

    from ..components import Geometry, get_component, load_model_config

    model = config.models[spec.model]
    definition = get_component(model.family, spec.component, spec.piece)
    model_config = load_model_config(model.source.path, model.family, spec.component)
    options = dict(spec.build_options)
    wrapper = definition.wrapper(module, model_config, options)
    feeds = definition.dummy_inputs(model_config, options, Geometry(spec.batch, spec.bucket.opt if spec.bucket else None))
    called: set[str] = set()
    hooks = [sub.register_forward_pre_hook(lambda _m, _a, name=name: called.add(name))
             for name, sub in module.named_modules()]
    try:
        with torch.inference_mode():
            wrapper(*[torch.from_numpy(feeds[name]) for name in wrapper.input_names])
    finally:
        for hook in hooks:
            hook.remove()
    return frozenset(name for name, _ in module.named_parameters() if name.rpartition(".")[0] not in called)


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
