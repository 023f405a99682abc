"""`build --ray ADDRESS|auto`: the engine matrix built on a Ray cluster whose nodes share the workspace.

Export and quantization run once per export group, each as a task; then one task per engine, asking for
the resources engines.yaml's `build.farm.resources` names for its target (or target/component), the
target's own needs (a GPU for tensorrt) and the memory the build stage estimates. Each task builds through
the same `build_one` as a local build — under the engine's lock, atomically, with provenance — so a key
is built once however many hosts try. A task whose worker dies is retried (Ray's `max_retries`), then
reported; a worker whose tool versions differ from the driver's refuses to build.
"""

from __future__ import annotations

import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engines_file import EnginesConfig, EngineSpec
from ..errors import BuildError, MissingDependencyError, TrtDiffusionError
from ..extras import install_line
from ..workspace.files import tool_versions
from .report import EngineOutcome, Failure

INSTALL_HINT = f"install the farm extra: {install_line('farm')}"
# (config, specs) -> (spec -> the ONNX its engine is built from), exporting and quantizing first
SourcesFor = Callable[[EnginesConfig, list[EngineSpec]], Callable[[EngineSpec], Path]]


def require_ray():
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(f"`build --ray` needs Ray ({exc}); {INSTALL_HINT}") from None
    return ray


def task_resources(config: EnginesConfig, spec: EngineSpec) -> dict[str, float]:
    """The custom resources an engine's task needs: `target/component` beats `target`."""
    table = config.build.farm.resources
    return dict(table.get(f"{spec.target}/{spec.component}", table.get(spec.target, {})))


def _version_problem(driver: dict) -> str | None:
    mine = tool_versions("provenance")
    differing = {name: (driver.get(name), mine.get(name)) for name in driver if driver.get(name) != mine.get(name)}
    if not differing:
        return None
    shown = ", ".join(f"{name} {a} on the driver, {b} here" for name, (a, b) in sorted(differing.items()))
    return f"worker {socket.gethostname()} has other tool versions than the driver ({shown}): engines built here would differ"


def _export_group(config_path: str, keys: list[str], driver_versions: dict, prepare: SourcesFor) -> dict[str, str]:
    """Task: export (and quantize) one group; spec key -> the ONNX its engine is built from."""
    from ..engines_file import expand, load_engines_file

    problem = _version_problem(driver_versions)
    if problem:
        raise BuildError(problem)
    config = load_engines_file(config_path, check_sources=True)
    specs = [s for s in expand(config) if s.key in keys]
    source_for = prepare(config, specs)
    return {spec.key: _portable(config, source_for(spec)) for spec in specs}


def _portable(config: EnginesConfig, path: Path) -> str:
    """A path inside the workspace relative to it (with a URL workspace each node has its own cache folder);
    nothing outside the workspace crosses between driver and workers."""
    try:
        return Path(path).resolve().relative_to(Path(config.workspace).resolve()).as_posix()
    except ValueError:
        raise BuildError(f"{path} is outside the workspace {config.workspace}: only workspace paths cross "
                         "between the Ray driver and its workers") from None


def _in_workspace(config: EnginesConfig, path: object, what: str) -> Path:
    """A path received across the driver/worker boundary: relative to the workspace and inside it (no absolute
    path, no '..', no symbolic link), else BuildError naming it."""
    from ..workspace.safe_paths import inside_folder

    return inside_folder(config.workspace, path, where=f"a Ray task's {what}", field="path", error=BuildError)


def _local_source(config: EnginesConfig, path: str, *, pull: bool = False) -> Path:
    """The ONNX a task builds from on this node (pulled from a URL workspace when this node lacks it)."""
    resolved = _in_workspace(config, path, "ONNX source")
    if pull and not resolved.is_file():
        from ..workspace.store_sync import pull_sources

        pull_sources(config)
    return resolved


def _build_engine(config_path: str, key: str, onnx_path: str, driver_versions: dict) -> dict[str, Any]:
    """Task: build one engine; a dict (picklable across Ray's process boundary) of its outcome."""
    import ray

    from ..engines_file import expand, load_engines_file
    from .stage import build_one

    start = time.perf_counter()
    node = ray.get_runtime_context().get_node_id()
    try:
        problem = _version_problem(driver_versions)
        if problem:
            raise BuildError(problem)
        config = load_engines_file(config_path, check_sources=True)
        spec = next(s for s in expand(config) if s.key == key)
        path, cached = build_one(config, spec, _local_source(config, onnx_path, pull=True))
        return {"path": _portable(config, path), "cached": cached, "seconds": time.perf_counter() - start, "node": node}
    except TrtDiffusionError as exc:
        return {"error": str(exc), "internal": False, "seconds": time.perf_counter() - start, "node": node}
    except Exception as exc:  # noqa: BLE001 - a bug: carried back with its traceback
        return {"error": traceback.format_exception_only(type(exc), exc)[-1].strip(), "internal": True,
                "traceback": traceback.format_exc(), "seconds": time.perf_counter() - start, "node": node}


def build_on_ray(config: EnginesConfig, specs: list[EngineSpec], *, address: str, prepare: SourcesFor,
                 groups: list[list[EngineSpec]],
                 progress: Callable[[str, EngineSpec | None], None] | None = None,
                 nodes: dict[str, str] | None = None) -> list[EngineOutcome]:
    """Build `specs` as Ray tasks. `groups` partition them by export (the specs one ONNX serves: one export
    task each); `prepare(config, specs)` exports (and quantizes) what they are built from and returns spec ->
    ONNX path (api.engine_sources); `nodes`, when given, receives spec key -> the id of the node that built it."""
    ray = require_ray()
    from .stage import memory_estimate

    progress = progress or (lambda message, spec: None)
    if not ray.is_initialized():
        ray.init(address=address, logging_level="ERROR",
                 log_to_driver=False, configure_logging=False)
    versions = tool_versions("provenance")
    config_path = str(Path(config.path).resolve())
    retries = config.build.farm.max_retries
    export_task = ray.remote(max_retries=retries)(_export_group)
    sources: dict[str, str] = {}
    failures: dict[str, Failure] = {}
    pending = {export_task.remote(config_path, [s.key for s in group], versions, prepare): group
               for group in groups}
    for ref, group in pending.items():
        try:
            sources.update(ray.get(ref))
        except Exception as exc:  # noqa: BLE001 - the group's engines are reported, the others still build
            message = _task_error(exc)
            for spec in group:
                failures[spec.key] = Failure(spec.name, spec.key, f"export failed: {message}")

    build_task = ray.remote(_build_engine)
    refs: dict[Any, EngineSpec] = {}
    for spec in specs:
        if spec.key in failures or spec.key not in sources:
            continue
        options = {"max_retries": retries, "num_cpus": 1, "resources": task_resources(config, spec) or None,
                   "memory": max(memory_estimate(_local_source(config, sources[spec.key])), 1)}
        needs = _target_needs(spec)
        options["resources"] = {**(options["resources"] or {}), **needs.pop("resources", {})} or None
        options.update(needs)
        refs[build_task.options(**{k: v for k, v in options.items() if v is not None}).remote(
            config_path, spec.key, sources[spec.key], versions)] = spec

    results: dict[str, EngineOutcome] = {}
    waiting = list(refs)
    while waiting:
        done, waiting = ray.wait(waiting, num_returns=1)
        spec = refs[done[0]]
        try:
            result = ray.get(done[0])
        except Exception as exc:  # noqa: BLE001 - the worker died past its retries
            result = {"error": f"the build task failed after {retries} retries: {_task_error(exc)}", "internal": False}
        if nodes is not None and "node" in result:
            nodes[spec.key] = result["node"]
        results[spec.key] = _outcome(config, spec, result)
        progress(results[spec.key].status.lower(), spec)
    for key, failure in failures.items():
        spec = next(s for s in specs if s.key == key)
        results[key] = EngineOutcome(spec, None, failure=failure)
        progress("failed", spec)
    return [results[s.key] for s in specs if s.key in results]


def _target_needs(spec: EngineSpec) -> dict[str, Any]:
    from ..targets import get_target

    return dict(get_target(spec.target).farm_needs(spec))


def _task_error(exc: Exception) -> str:
    cause = getattr(exc, "cause", None)
    return str(cause or exc).strip().splitlines()[-1] if str(cause or exc).strip() else type(exc).__name__


def _outcome(config: EnginesConfig, spec: EngineSpec, result: dict) -> EngineOutcome:
    if "error" in result:
        failure = Failure(spec.name, spec.key, str(result["error"]), internal=bool(result.get("internal")),
                          traceback=result.get("traceback"))
        return EngineOutcome(spec, None, seconds=result.get("seconds", 0.0), failure=failure)
    try:  # the driver walks this path (provenance, publish): it must be an engine of this workspace
        path = _in_workspace(config, result.get("path"), "engine path")
        if Path(result["path"]).parts[0] != "engines":
            raise BuildError(f"a Ray task's engine path {result['path']!r} is not under engines/ of the workspace")
    except BuildError as exc:
        return EngineOutcome(spec, None, failure=Failure(spec.name, spec.key, str(exc)))
    return EngineOutcome(spec, path, cached=bool(result.get("cached")), seconds=float(result.get("seconds", 0.0)))
