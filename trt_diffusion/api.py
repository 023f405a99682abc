"""One function per stage. The CLI and the Makefile call these; they know nothing about argv."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .engines_file import load_engines_file
from .plan import Plan, make_plan

if TYPE_CHECKING:
    from .export import ExportReport
    from .export.stage import ProgressCallback


def plan(config_path: str | Path, *, count_parameters: bool = True) -> Plan:
    """Expand engines.yaml into the engine matrix, with counts, reasons and disk estimates."""
    config = load_engines_file(config_path, check_sources=True)
    return make_plan(config, count_parameters=count_parameters)


def make_tiny_model(out_dir: str | Path, family: str, *, seed: int = 0, size: str = "tiny",
                    controlnet: bool = False, lora: bool = False, overwrite: bool = False,
                    variant: str | None = None) -> Path:
    """Write a seeded reference pipeline folder (see models/tiny.py)."""
    from .models.tiny import write_tiny_model

    return write_tiny_model(out_dir, family, seed=seed, size=size, controlnet=controlnet, lora=lora,
                            overwrite=overwrite, variant=variant)


def make_micro_model(out_dir: str | Path, family: str = "sd15", *, overwrite: bool = False) -> Path:
    """Write the trained micro-model of `family` as a diffusers folder, upcast to fp32 (see models/micro.py)."""
    from .models.micro import write_micro_model

    return write_micro_model(family, out_dir, overwrite=overwrite)


def export(config_path: str | Path, model: str | None = None, component: str | None = None,
           progress: ProgressCallback | None = None) -> ExportReport:
    """Export every component engines.yaml needs to ONNX, verified against PyTorch, reusing verified artifacts.

    One ONNX per export group (see export/grouping.py); `report.artifact_for(spec)` is the ONNX a spec's
    engine is built from. Artifacts live in `<workspace>/onnx/<name>.<key>/`.
    """
    from .engines_file.selection import select_specs

    config = load_engines_file(config_path, check_sources=True)
    return export_specs(config, select_specs(config, model, component), progress=progress)


def export_specs(config, specs, progress: ProgressCallback | None = None) -> ExportReport:
    """Export the ONNX graphs these specs' engines are built from (verified artifacts are reused)."""
    from .export import ExportReport, group_specs
    from .export.export_state import fingerprint, record, unchanged_report
    from .workspace import store_sync
    from .workspace.store import ArtifactStore

    groups = group_specs(specs)
    store_sync.pull_sources(config)  # a URL workspace: what other hosts exported is reused
    # nothing changed since the last complete export (stats only): no file hashed, torch not imported. The stats
    # are taken once, before the export: what changes while it runs is not recorded as what it read
    inputs = fingerprint(config, groups)
    report = unchanged_report(config, groups, progress, inputs)
    if report is None:
        from .export import export_group

        store = ArtifactStore(config.workspace)
        report = ExportReport([export_group(group, config, store, index=i, total=len(groups), progress=progress)
                               for i, group in enumerate(groups)])
        record(config, groups, report, inputs)
    store_sync.publish_sources(config)
    return report


def engine_sources(config, specs):
    """spec -> the ONNX its engine is built from: exported (and for fp8/int8, quantized and gated) first."""
    from .workspace import store_sync

    exports = export_specs(config, specs)
    quantized = _quantized_sources(config, specs)
    if quantized:
        store_sync.publish_sources(config)
    return lambda spec: quantized.get(spec.key) or exports.artifact_for(spec)


def build(config_path: str | Path, *, target: str | None = None, model: str | None = None,
          component: str | None = None, jobs: int | None = None, shard: tuple[int, int] | None = None,
          ray: str | None = None, progress=None):
    """Build every engine engines.yaml asks for, on every target this machine can build.

    Exports first (cached when unchanged); engines whose inputs are unchanged are reused. Targets this
    machine cannot build (TensorRT without TensorRT or a GPU) are skipped and said so in the report;
    asking for such a target explicitly is an error. `shard=(i, n)` builds the i-th of n deterministic
    parts of the matrix (by key) for CI matrices; `ray` ("auto" or HOST:PORT) builds one Ray task per
    engine on a cluster sharing the workspace.
    """
    from .engine_builds.stage import build_engines
    from .engines_file.selection import select_specs

    # the extras asked for by name fail now, with the pip line, before engines.yaml is read or anything exported
    if target is not None:
        from .target_registry import require_target_extra

        require_target_extra(target)
    if ray is not None:
        from .extras import require

        require("farm", "`build --ray`", ("ray",))
    config = load_engines_file(config_path, check_sources=True)
    return build_engines(config, select_specs(config, model, component), prepare=engine_sources, target=target,
                         narrowed=bool(model or component), jobs=jobs, shard=shard, ray=ray, progress=progress)


def manifest(config_path: str | Path, *, verify: bool = True, out: str | Path | None = None) -> dict:
    """The release manifest: every engine's key, provenance (host, CPU/GPU, tool versions, build time, size)
    and the sha256 of its files, verified against the workspace; written to `out` (default
    <workspace>/release-manifest.json)."""
    import json

    from .engines_file import expand
    from .workspace.files import atomic_write_bytes
    from .workspace.provenance import release_manifest
    from .workspace.store_sync import pull_engines

    config = load_engines_file(config_path, check_sources=True)
    pull_engines(config, [spec.key for spec in expand(config)])  # a URL workspace: what the build hosts made
    result = release_manifest(config, expand(config), verify=verify)
    path = Path(out) if out else config.workspace / "release-manifest.json"
    atomic_write_bytes(path, json.dumps(result, indent=2).encode())
    result["path"] = str(path)
    return result


def _quantized_sources(config, specs) -> dict[str, Path]:
    """spec key -> Q/DQ ONNX for fp8/int8 specs (quantizing what is not cached yet; the gate must pass)."""
    from .quantize.stage import quantize_component

    sources, done = {}, {}
    for spec in specs:
        if not spec.precision.is_quantized:
            continue
        # a step cache's piece is its own Q/DQ graph, from the denoiser's calibration (quantize/pieces.py)
        variant = (spec.model, spec.component, spec.precision, spec.lora_variant, spec.piece)
        if variant not in done:
            done[variant] = quantize_component(
                config.models[spec.model], spec.component, spec.precision, spec.lora_variant,
                config.workspace, opset=config.build.opset, config_root=config.root, piece=spec.piece).onnx_path
        sources[spec.key] = done[variant]
    return sources


def quantize(config_path: str | Path, model: str | None = None, *, force: bool = False):
    """ModelOpt FP8/INT8 of every fp8/int8 entry: seeded calibration, Q/DQ ONNX, quality gate."""
    from .quantize.stage import quantize as run
    from .workspace import store_sync

    config = load_engines_file(config_path, check_sources=False)
    store_sync.pull_sources(config)
    result = run(config_path, model, force=force)
    store_sync.publish_sources(config)
    return result


def parity(config_path: str | Path, *, out_dir: str | Path | None = None, prompts_file: str | Path | None = None,
           seeds: list[int] | None = None, steps: int = 4, targets: list[str] | None = None, progress=None):
    """Same-seed images of every built variant vs the fp32 PyTorch reference; writes JSON + HTML reports."""
    from .errors import ConfigError
    from .parity.stage import ParityOptions, run_parity

    config = load_engines_file(config_path, check_sources=True)
    options = ParityOptions(steps=steps)
    if prompts_file is not None:
        try:
            lines = [line.strip() for line in Path(prompts_file).read_text().splitlines()]
        except OSError as exc:
            raise ConfigError(f"{prompts_file}: cannot read: {exc.strerror}") from None
        options.prompts = tuple(line for line in lines if line and not line.startswith("#"))
        if not options.prompts:
            raise ConfigError(f"{prompts_file}: no prompts (one a line; # starts a comment)")
    if seeds:
        options.seeds = tuple(seeds)
    out = Path(out_dir) if out_dir else config.workspace / "reports" / "parity"
    return run_parity(config, out, options, targets=targets, progress=progress)


def refit(config_path: str | Path, model: str, loras: list[tuple[str | Path, float]], *,
          target: str = "onnxruntime", base: bool = False):
    """Apply LoRAs (file, scale) to every refittable engine of `model` (the denoiser's part to the denoiser
    engines, the text encoders' parts to the text-encoder engines), or restore the base.

    onnxruntime: checks the LoRA fits every engine and creates the refitted sessions (what a server does at
    load time); tensorrt: refits the engines in place with TensorRT's Refitter and saves them.
    Returns [(engine name, weights changed, seconds)].
    """
    import time
    from functools import cache

    from .errors import RefitError
    from .runtime.loader import built_engines, refit_weights
    from .targets import get_target
    from .workspace.locks import engine_lock

    config = load_engines_file(config_path, check_sources=True)
    engines = [e for e in built_engines(config, model, target) if e.spec.refittable]
    if not engines:
        raise RefitError(f"{model} has no refittable {target} engines: give it a `mode: refit` LoRA or "
                         "`refittable: true` in engines.yaml and rebuild")
    if base:
        loras = []
    weights = refit_weights(config, model, [(Path(p), s) for p, s in loras],
                            refittable={e.spec.component for e in engines}) if loras else {}

    @cache
    def exports():  # only targets that refit from the source ONNX ask: export (cached) once per command
        return export(config_path, model=model)

    chosen = get_target(target)
    results = []
    for engine in engines:
        start = time.perf_counter()
        # every refittable engine is refitted, from base: one the LoRAs do not touch goes back to its base weights;
        # under the engine's build lock, so a build of it never runs at the same time (nor cleans the refit's files)
        with engine_lock(config.workspace, engine.spec.key):
            changed = chosen.refit(engine, weights.get(engine.spec.component) or None,
                                   lambda spec=engine.spec: exports().artifact_for(spec))
        results.append((engine.spec.name, changed, time.perf_counter() - start))
    return results


def preflight(config_path: str | Path, *, url: str | None = None, protocol: str = "grpc",
              metrics_url: str | None = None, only: list[str] | None = None, skip: list[str] | None = None,
              save_baseline: bool = False, model: str | None = None, target: str | None = None,
              out_dir: str | Path | None = None, in_process: bool = False, deployment=None, progress=None,
              save_baseline_if_missing: bool = False):
    """The pre-launch checklist (docs/preflight.md) against a server preflight starts on loopback from the built
    engines, the one at `url`, or in process; writes preflight.json + preflight.html. The report's `passed`
    says whether every check passed (the CLI exits 1 when not)."""
    from .preflight.run import run_preflight

    config = load_engines_file(config_path, check_sources=True)
    return run_preflight(config, url=url, protocol=protocol, metrics_url=metrics_url, only=only, skip=skip,
                         save_baseline=save_baseline, model=model, target=target,
                         out_dir=Path(out_dir) if out_dir else None, in_process=in_process, deployment=deployment,
                         progress=progress, save_baseline_if_missing=save_baseline_if_missing)


def generate_in_process(config_path: str | Path, request, *, model: str | None = None,
                        target: str = "onnxruntime"):
    """Images for one `triton.client.ImageRequest` from the built engines, in this process (no server), as
    TensorRT's diffusion demo runs them: (images uint8 [N, H, W, 3], or a video model's [N, F, H, W, 3], the
    model's name). N = request.num_images; `video_files.save_videos` writes videos."""
    import numpy as np

    from .runtime.loader import engine_runners
    from .runtime.pipeline import EnginePipeline, GenerationRequest

    config = load_engines_file(config_path, check_sources=True)
    model = _one_model(config, model)
    model_dir, family, table = engine_runners(config, model, target)
    # the workflows engines.yaml declares, as the served entry gets them (package records them)
    # cfg: parallel runs as declared; text_lengths: a Qwen-Image model's engines.yaml range, where its engines end
    # (prompts are truncated there, as the served entry truncates them)
    pipeline = EnginePipeline(model_dir, family, table, workflows=config.models[model].workflows,
                              cfg=config.models[model].cfg, text_lengths=config.models[model].text_lengths,
                              step_cache=config.models[model].step_cache)
    images = [pipeline.generate(GenerationRequest(  # NUM_IMAGES as the server reads it: seeds SEED, SEED + 1, ...
        prompt=request.prompt, height=request.height, width=request.width, steps=request.steps,
        guidance_scale=request.guidance_scale, seed=request.seed + i, negative_prompt=request.negative_prompt,
        scheduler=request.scheduler or "default", controlnet=request.controlnet, control_image=request.control_image,
        controlnet_scale=1.0 if request.controlnet_scale is None else request.controlnet_scale,
        workflow=request.workflow, init_image=request.init_image, mask=request.mask,
        strength=request.strength, frames=request.frames or 0, guidance_scale_2=request.guidance_scale_2,
        max_sequence_length=request.max_sequence_length, step_cache=request.step_cache,
        inputs=dict(request.inputs or {}))).images[0]
        for i in range(request.num_images or 1)]
    return np.stack(images), model


def _one_model(config, model: str | None) -> str:
    """The model a --config command runs: the one named, or the file's only one."""
    from .errors import ConfigError

    if model is not None:
        return model
    if len(config.models) != 1:
        raise ConfigError(f"{config.path} has {len(config.models)} models ({', '.join(config.models)}); "
                          "name one with --model")
    (model,) = config.models
    return model


def first_bucket_size(config_path: str | Path, model: str | None = None):
    """The size a --config request gets when it names none: the model's first bucket (its opt size), as a request
    to a server gets the server's first served size."""
    config = load_engines_file(config_path)
    model = _one_model(config, model)
    if model not in config.models:
        from .errors import ConfigError

        raise ConfigError(f"{config.path} has no model {model!r} (it has {', '.join(config.models)})")
    return config.models[model].buckets[0].opt


def package(config_path: str | Path, out_dir: str | Path = "triton_repo", target: str = "onnxruntime", *,
            model: str | Sequence[str] | None = None, options=None, lora_variant: str | None = None,
            verify_keys: Sequence[str | Path] = (), release: str | Path | None = None, all_models: bool = False,
            memory_budget_gb: float | None = None, sign_key: str | Path | None = None,
            kubernetes: str | Path | None = None, kubernetes_options=None):
    """A Triton model repository serving the built engines of one model of engines.yaml, or of several (`model` a
    list, or `all_models`: an entry per model) (triton/stage.py): engine models from each target's `triton_model`,
    the entry and its BLS loop, the ensemble, warm-up. `memory_budget_gb` (default: engines.yaml's preflight
    max_rss_gb): the models' estimated served memory must fit it. `verify_keys`: package only engines a signed
    release manifest covers; `sign_key` (with `verify_keys`): sign every file of the repository written, what
    `serve --verify` requires (docs/security.md). `kubernetes` (a folder): also the manifests that serve the
    repository in a cluster (triton/kubernetes.py; `kubernetes_options` a KubernetesOptions), their values checked
    before anything is written."""
    from .triton import stage

    if kubernetes is not None:
        from .openai_api.overload import policies_from_config
        from .triton import kubernetes as k8s

        kubernetes_options = (kubernetes_options or k8s.KubernetesOptions()).check()
        k8s.check_out_dir(kubernetes, out_dir)
        # the cluster's API starts with --config engines.yaml when a model has an overload policy: refuse here what
        # would stop it there (a degrade size the model does not serve), before anything is written
        policies_from_config(load_engines_file(config_path, check_sources=False))
    report = stage.package_stage(config_path, out_dir, target, model=model, options=options,
                                 lora_variant=lora_variant, verify_keys=verify_keys, release=release,
                                 all_models=all_models, memory_budget_gb=memory_budget_gb, sign_key=sign_key)
    if kubernetes is not None:
        k8s.write(kubernetes, out_dir, report, kubernetes_options, config_path)  # its overload policies: --config
    return report


def serve(repo: str | Path, *, http_port: int | None = 8000, grpc_port: int | None = 8001,
          metrics_port: int | None = 8002, first_request: bool = True, on_ready=None, admin_apis: bool = False,
          verify_keys: Sequence[str | Path] = (), openai=None, memory_budget_gb: float | None = None,
          triton_http: bool = True, replicas: int = 1):
    """tritonserver on a packaged repository (127.0.0.1) until Ctrl-C or SIGTERM: `on_ready(report)` once every
    model is ready and warm; the warm-up report, or None when stopped before the server was ready. `openai`
    (openai_api.settings.ApiSettings): also the OpenAI Images API, started once Triton is ready, talking to its
    gRPC port, stopped with it. `triton_http=False`: tritonserver without its HTTP and metrics ports (gRPC only).
    `replicas` > 1: that many tritonservers on this host (triton/stage.py serve), the API fronting all of them as
    `openai-api --triton-url ... --triton-metrics-url ...` does (openai_api/replicas.py: each replica's queue read
    from its metrics port, unless triton_http is off); `on_ready` gets, and the call returns, the list of their
    reports."""
    from dataclasses import replace

    from .triton import stage

    started = []
    if openai is not None:
        from .extras import require

        require("openai", "--openai-port")  # before tritonserver starts, not once it is ready
        from .openai_api.server import ApiServer, check_port

        check_port(openai.check())  # a taken port fails now, not after the models have loaded

    def ready(report) -> None:
        if openai is not None:
            reports = report if isinstance(report, list) else [report]
            metrics = tuple(r.metrics_url for r in reports)  # "" each without Triton's metrics port
            started.append(ApiServer(replace(openai, triton_url=",".join(r.grpc_url for r in reports),
                                             triton_metrics_urls=metrics if all(metrics) else ())).start())
        if on_ready:
            on_ready(report)

    try:
        return stage.serve(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                           first_request=first_request, on_ready=ready, admin_apis=admin_apis,
                           verify_keys=verify_keys, memory_budget_gb=memory_budget_gb, triton_http=triton_http,
                           replicas=replicas)
    finally:
        for server in started:
            server.stop()


def openai_api(settings) -> None:
    """The OpenAI Images API alone, in the foreground, in front of the Triton at `settings.triton_url` (gRPC);
    until Ctrl-C or SIGTERM."""
    from .extras import require

    require("openai", "openai-api")
    from .openai_api.server import run

    run(settings)


def generate(request, *, url: str = "127.0.0.1:8000", protocol: str = "http", pipeline: str | None = None,
             timeout_s: float = 300.0, config: str | Path | None = None, model: str | None = None,
             target: str = "onnxruntime", on_preview=None, preview_every: int = 5, deadline=None):
    """Images for one `triton.client.ImageRequest`: (images uint8 [N, H, W, 3] or videos [N, F, H, W, 3], the
    server's response parameters, the pipeline's name). From the server at `url` (`pipeline`: its model, default the only one); with
    `on_preview(step, image)`, streamed over gRPC from `<pipeline>_stream`, one image, a preview every
    `preview_every` steps; with `config` (engines.yaml), from its built engines in this process (no parameters).
    `deadline` (triton.client_limits.Deadline): the caller's, shared with what it asked the server before."""
    if config is not None:
        images, name = generate_in_process(config, request, model=model, target=target)
        return images, {}, name
    if on_preview is not None:
        from .triton.client import connect, find_pipeline, stream

        if pipeline is None:
            client = connect(url, "grpc", 60.0, deadline=deadline)
            try:
                pipeline = find_pipeline(client, url, deadline=deadline, protocol="grpc")
            finally:
                client.close()
        image, _, parameters = stream(url, request, model=f"{pipeline}_stream", preview_every=preview_every,
                                      timeout_s=timeout_s if deadline is None else deadline.left(),
                                      on_preview=on_preview)
        return image[None], parameters, pipeline
    from .triton.client import generate_images

    images, parameters = generate_images(url, request, pipeline=pipeline, protocol=protocol, timeout_s=timeout_s,
                                         deadline=deadline)
    return images, parameters, pipeline
