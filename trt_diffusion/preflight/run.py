"""The preflight stage: check the inputs, open the deployment, run the selected checks (each with its own
timeout), write the report.

Everything that can be refused is refused before a server starts or a file is written: unknown check names, a
missing or foreign baseline, engines that are not built, an unreachable URL or a server serving another model.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..checklist import CHECK_NAMES
from ..engines_file import EnginesConfig
from .checks import get_check
from .checks.base import CheckContext, Outcome
from .errors import PreflightError
from .model import CheckResult, PreflightReport

# Buckets first (the first requests after start), the disruptive ones (memory load, cancellation, overload) last.
RUN_ORDER = ("buckets", "reproducibility", "isolation", "plugins", "quality", "memory", "cancellation", "overload")
assert sorted(RUN_ORDER) == sorted(CHECK_NAMES)


@dataclass
class PreflightRun:
    report: PreflightReport
    files: object  # files.ReportFiles
    baseline: Path | None = None  # the baseline folder written by --save-baseline


def select(only: list[str] | None, skip: list[str] | None) -> list[str]:
    for name in [*(only or []), *(skip or [])]:
        if name not in CHECK_NAMES:
            raise PreflightError(f"unknown check {name!r}; checks: {', '.join(CHECK_NAMES)}")
    chosen = [n for n in CHECK_NAMES if (not only or n in only) and n not in (skip or [])]
    if not chosen:
        raise PreflightError("--only / --skip leave no check to run")
    return chosen


def resolve_model(config: EnginesConfig, model: str | None) -> str:
    model = model or config.preflight.model
    if model is None:
        if len(config.models) != 1:
            raise PreflightError(f"{config.path} has {len(config.models)} models ({', '.join(config.models)}); "
                                 "choose one with --model or preflight.model")
        return next(iter(config.models))
    if model not in config.models:
        raise PreflightError(f"no model named {model!r} in {config.path} (models: {', '.join(config.models)})")
    return model


def run_preflight(config: EnginesConfig, *, url: str | None = None, protocol: str = "grpc",
                  metrics_url: str | None = None, only: list[str] | None = None, skip: list[str] | None = None,
                  save_baseline: bool = False, model: str | None = None, target: str | None = None,
                  out_dir: Path | None = None, in_process: bool = False, deployment=None,
                  progress: Callable[[str], None] | None = None, save_baseline_if_missing: bool = False
                  ) -> PreflightRun:
    """`deployment`: an already open Deployment to check (tests); else one is opened here and closed after.
    `save_baseline_if_missing`: a first run saves the quality baseline where this file's settings keep it."""
    from . import connect
    from .baseline import BASELINE_FILE, folder_for, load_baseline
    from .baseline import save_baseline as write_baseline
    from .files import write_report

    progress = progress or (lambda message: None)
    settings = config.preflight
    chosen = select(only, skip)
    model = resolve_model(config, model)
    if save_baseline_if_missing and "quality" in chosen:
        save_baseline = save_baseline or not (folder_for(config, model, settings) / BASELINE_FILE).is_file()
    if save_baseline and "quality" not in chosen:
        raise PreflightError("--save-baseline records the quality check's images: do not leave `quality` out")
    target = target or settings.target
    if target not in config.models[model].targets:
        raise PreflightError(f"{model} does not build the {target} target (targets: "
                             f"{', '.join(config.models[model].targets)})")
    if url is not None and in_process:
        raise PreflightError("--url and --in-process exclude each other")
    engines = connect.find_engines(config, model, target)
    out = Path(out_dir) if out_dir else (Path(config.root) / settings.out if settings.out
                                         else Path(config.workspace) / "reports" / "preflight")
    baseline = None
    if "quality" in chosen and not save_baseline:  # before any server starts: a missing baseline fails fast
        servable = connect.servable(engines)
        baseline = load_baseline(folder_for(config, model, settings), model=model,
                                 engine_keys=[e.spec.key for e in servable], quality=settings.quality,
                                 size=str(connect.served_buckets(servable)[0].request), config_path=config.path,
                                 workflows=config.models[model].workflows)
    owned = deployment is None
    work_dir = None
    try:
        if deployment is None:
            if in_process:
                deployment = connect.in_process(config, engines)
            elif url is not None:
                progress(f"connecting to {url} ({protocol})")
                deployment = connect.connect_served(url, protocol, config, engines, metrics_url)
            else:
                progress("packaging the built engines and starting tritonserver on 127.0.0.1")
                work_dir = Path(tempfile.mkdtemp(prefix="trt-diffusion-preflight-"))
                deployment = connect.start_served(config, engines, protocol=protocol, work_dir=work_dir,
                                                  ready_timeout_s=settings.ready_timeout_s,
                                                  first_request_steps=settings.buckets.steps)
        if baseline is not None and sorted(baseline.engine_keys) != sorted(deployment.engine_keys):
            raise PreflightError(f"the quality baseline at {baseline.folder} was saved from other engines than "
                                 f"{deployment.url or 'the deployment'} serves; save a new one with "
                                 f"`trt-diffusion preflight {config.path} --save-baseline`")
        ctx = CheckContext(config, model, target, settings, deployment, engines, baseline=baseline,
                           save_baseline=save_baseline)
        results = {}
        for name in (n for n in RUN_ORDER if n in chosen):
            progress(f"check {name}")
            results[name] = run_check(name, ctx)
        checks = [results[name] for name in CHECK_NAMES if name in results]
        report = PreflightReport.build(config=str(config.path), model=model, target=target,
                                       deployment=deployment.describe(), checks=checks,
                                       not_run=[n for n in CHECK_NAMES if n not in chosen])
        written_baseline = None
        if save_baseline and "baseline" in ctx.saved:
            written_baseline = write_baseline(ctx.saved["baseline"])
        files = write_report(report, out, ctx.saved.get("report_images", {}))
        return PreflightRun(report, files, written_baseline)
    finally:
        if owned and deployment is not None:
            deployment.close()
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)


def run_check(name: str, ctx: CheckContext) -> CheckResult:
    """One check in a thread, bounded by its own timeout; an exception in it is its failure, with the reason."""
    check = get_check(name)
    timeout = ctx.settings.check(name).timeout_s
    ctx.deadline = time.monotonic() + timeout
    box: dict = {}

    def target() -> None:
        try:
            box["outcome"] = check.run(ctx)
        except Exception as err:  # noqa: BLE001 - reported as the check's failure, with where it happened
            box["error"] = err
            box["traceback"] = traceback.format_exc(limit=6)

    start = time.perf_counter()
    thread = threading.Thread(target=target, name=f"preflight-{name}", daemon=True)
    thread.start()
    thread.join(timeout)
    seconds = time.perf_counter() - start
    if thread.is_alive():
        outcome = Outcome(summary=f"did not finish within {timeout:g} s",
                          failures=[f"did not finish within its timeout of {timeout:g} s "
                                    f"(preflight.{name}.timeout_s)"])
    elif "error" in box:
        err = box["error"]
        outcome = Outcome(summary=f"failed: {err}", failures=[f"{type(err).__name__}: {err}"],
                          notes=[box["traceback"]])
    else:
        outcome = box["outcome"]
    return CheckResult(name=name, title=check.title, status=outcome.status, summary=outcome.summary,
                       figures=outcome.figures, thresholds=outcome.thresholds, rows=outcome.rows,
                       failures=outcome.failures, notes=outcome.notes, reason=outcome.reason,
                       seconds=seconds, timeout_s=timeout)
