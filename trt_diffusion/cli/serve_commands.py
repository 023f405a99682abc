"""The serving commands: package (a Triton model repository), serve (tritonserver on it), generate (ask it)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..families import request_inputs_of_all
from ..targets import check_target_name, target_names
from ..video_files import DEFAULT_FPS
from .console import console
from .openai_commands import (
    DEFAULT_JOB_TIMEOUT_S,
    DEFAULT_MAX_BODY,
    DEFAULT_STATE_MAX_GB,
    AllowedHosts,
    ApiKey,
    CorsOrigins,
    JobTimeout,
    MaxBody,
    ServingConfig,
    StateDir,
    StateMaxGb,
    names,
    overload_options,
    state_options,
)
from .options import Transport


class EngineBackend(str, Enum):
    python = "python"
    native = "native"


class WarmupData(str, Enum):
    zero = "zero"
    random = "random"


def package_command(
    config: Annotated[Path, typer.Argument(help="engines.yaml")],
    out: Annotated[Path, typer.Option("--out", help="repository folder to write (replaced if we wrote it)")]
    = Path("triton_repo"),
    model: Annotated[list[str] | None, typer.Option("--model", help="a model of engines.yaml to package "
                                                    "(repeatable: one repository, an entry per model)")] = None,
    all_models: Annotated[bool, typer.Option("--all-models", help="package every model of engines.yaml")] = False,
    memory_budget_gb: Annotated[float | None, typer.Option(
        "--memory-budget-gb", min=0.001, help="refuse models whose estimated served memory exceeds this (default: "
        "engines.yaml's preflight max_rss_gb)")] = None,
    target: Annotated[str, typer.Option("--target", help="which built engines to serve: "
                                        f"{' | '.join(target_names())}")] = "onnxruntime",
    engine_backend: Annotated[EngineBackend, typer.Option(
        "--engine-backend", help="python: the target's runner inside python-backend models (runs on the "
        "tritonserver bundled in nvidia-pytriton); native: the target's own Triton backend (onnxruntime, "
        "openvino: NVIDIA's containers). tensorrt engines are always served as tensorrt_plan")]
    = EngineBackend.python,
    instances: Annotated[int, typer.Option("--instances", min=1, help="instances of the pipeline (denoise) models;"
                                           " 2 avoids a 500 ms stall of Triton 2.51's batcher with one")] = 2,
    engine_instances: Annotated[int, typer.Option("--engine-instances", min=1, help="instances per engine model "
                                                  "(per GPU with --gpu)")] = 1,
    gpus: Annotated[list[int] | None, typer.Option("--gpu", min=0, help="GPU the engine models' GPU instances run on "
                                                   "(repeatable; default: every GPU Triton sees)")] = None,
    max_queue_size: Annotated[int, typer.Option("--max-queue-size", min=1,
                                                help="waiting requests beyond this are refused at once")] = 8,
    queue_timeout_s: Annotated[float, typer.Option("--queue-timeout", help="seconds a request may wait queued")]
    = 60.0,
    warmup_data: Annotated[WarmupData, typer.Option("--warmup-data", help="engine warm-up inputs")]
    = WarmupData.zero,
    ensemble: Annotated[bool, typer.Option("--ensemble/--no-ensemble",
                                           help="also write <pipeline>_ensemble and its stage models")] = True,
    batch_requests: Annotated[int | None, typer.Option(
        "--batch-requests", min=1, help="requests the entry gathers into one batch at most (shared denoiser calls "
        "over batch-N engines); default: what one call of the biggest UNet engine takes with CFG (batch 8: 4)")]
    = None,
    batch_delay_ms: Annotated[float, typer.Option("--batch-delay-ms", min=0, max=10000, help="longest wait for "
                                                  "batch partners (0 where the engines are batch 1 only and --batch-requests is not set)")] = 5.0,
    max_images: Annotated[int, typer.Option("--max-images", min=1, help="NUM_IMAGES of one request at most")] = 8,
    lora_cache_sets: Annotated[int, typer.Option("--lora-cache-sets", min=1, help="LoRA sets each engine instance "
                                                 "keeps applied (LRU; each holds a refitted copy of the engine's "
                                                 "weights)")] = 4,
    stream: Annotated[bool, typer.Option("--stream/--no-stream",
                                         help="also write <pipeline>_stream (gRPC streaming, previews)")] = True,
    verify_keys: Annotated[list[Path] | None, typer.Option("--verify", help="public key: package only engines the "
                                                           "signed release manifest covers (repeatable)")] = None,
    sign_key: Annotated[Path | None, typer.Option("--sign", help="private key (release host, with --verify): sign "
                                                  "every file of the repository, which serve --verify requires")]
    = None,
    kubernetes: Annotated[Path | None, typer.Option("--kubernetes", help="also write Kubernetes manifests for the "
                                                    "repository into this folder (docs/deploy.md)")] = None,
    replicas: Annotated[int | None, typer.Option("--replicas", help="(--kubernetes) tritonserver pods; default 1")]
    = None,
    image: Annotated[str | None, typer.Option("--image", help="(--kubernetes) the image of both Deployments: "
                                              "tritonserver with trt-diffusion installed; default "
                                              "trt-diffusion:<version>")] = None,
    kubernetes_name: Annotated[str | None, typer.Option("--kubernetes-name", help="(--kubernetes) the objects' "
                                                        "name prefix (a DNS-1123 label); default the entry's name")]
    = None,
    namespace: Annotated[str | None, typer.Option("--namespace", help="(--kubernetes) default: default")] = None,
    repository_claim: Annotated[str | None, typer.Option("--repository-claim", help="(--kubernetes) the "
                                                         "PersistentVolumeClaim holding the repository; default "
                                                         "<name>-repository")] = None,
    max_replicas: Annotated[int | None, typer.Option("--max-replicas", help="(--kubernetes) also an HPA scaling "
                                                     "tritonserver pods up to this on Triton's queue (needs a "
                                                     "custom-metrics adapter)")] = None,
):
    """Write a Triton model repository serving the built engines of one model."""
    from .. import api
    from ..triton.repository import PackageOptions

    kubernetes_options = _kubernetes_options(kubernetes, replicas=replicas, image=image, name=kubernetes_name,
                                             namespace=namespace, repository_claim=repository_claim,
                                             max_replicas=max_replicas)
    options = PackageOptions(engine_backend=engine_backend.value, pipeline_instances=instances,
                             engine_instances=engine_instances, gpus=tuple(gpus or ()), max_queue_size=max_queue_size,
                             queue_timeout_s=queue_timeout_s, warmup_data=warmup_data.value, ensemble=ensemble,
                             batch_requests=batch_requests, batch_delay_ms=batch_delay_ms, max_images=max_images,
                             stream=stream, lora_cache_sets=lora_cache_sets)
    report = api.package(config, out, check_target_name(target), model=model or None, options=options,
                         verify_keys=verify_keys or (), all_models=all_models, memory_budget_gb=memory_budget_gb,
                         sign_key=sign_key, kubernetes=kubernetes, kubernetes_options=kubernetes_options)
    table = Table(title=f"Triton repository {report.repo}")
    for column in ("model", "role", "backend", "component", "bucket", "batch", "warm-up shapes"):
        table.add_column(column)
    for m in report.models:
        batch = "" if m.batch is None else str(m.batch)
        warmups = str(m.warmup_samples) if m.role == "engine" else ""
        table.add_row(m.name, m.role, m.backend, m.component or "", m.bucket or "", batch, warmups)
    console.print(table)
    for pipeline in report.all_pipelines():
        console.print(f"public entry: [bold]{pipeline.entry}[/bold]" + (f" (and the ensemble {pipeline.ensemble})"
                                                                         if pipeline.ensemble else "")
                      + f"; sizes: {', '.join(pipeline.sizes)}")
        if pipeline.loras:
            console.print(f"LoRAs per request at {pipeline.entry} (LORAS / generate --lora): "
                          f"{', '.join(pipeline.loras)}; each engine instance keeps {options.lora_cache_sets} set(s) "
                          "applied")
    for share in report.memory:
        console.print(f"estimated memory: {share['model']} {share['total_gb']:.2f} GB (engines "
                      f"{share['engines_gb']:.2f} GB, {share['processes']} python processes)", highlight=False)
    console.print(f"written in {report.seconds:.1f} s")
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if kubernetes is not None:
        console.print(f"Kubernetes manifests: {kubernetes} (kubectl apply -f {kubernetes}; docs/deploy.md)",
                      highlight=False)
    console.print(f"next: trt-diffusion serve --repo {out}")


def _kubernetes_options(folder: Path | None, **values):
    """package's --kubernetes options (KubernetesOptions, checked), None without --kubernetes; an option given
    without it is an error naming it."""
    from ..errors import ServeError

    given = {key: value for key, value in values.items() if value is not None}
    if folder is None:
        if given:
            option = {"name": "kubernetes-name"}.get(next(iter(given)), next(iter(given))).replace("_", "-")
            raise ServeError(f"--{option} is an option of the Kubernetes manifests: give --kubernetes DIR too")
        return None
    from ..triton.kubernetes import KubernetesOptions

    return KubernetesOptions(**given).check()


def serve_command(
    repo: Annotated[Path, typer.Option("--repo", help="repository written by `trt-diffusion package`")]
    = Path("triton_repo"),
    http_port: Annotated[int, typer.Option("--http-port")] = 8000,
    grpc_port: Annotated[int, typer.Option("--grpc-port")] = 8001,
    metrics_port: Annotated[int, typer.Option("--metrics-port")] = 8002,
    first_request: Annotated[bool, typer.Option("--first-request/--no-first-request",
                                                help="time one request per bucket once ready")] = True,
    admin_apis: Annotated[bool, typer.Option("--admin-apis", help="leave Triton's shared-memory, trace and logging "
                                             "APIs open to every client (restricted by default; docs/security.md)")]
    = False,
    verify_keys: Annotated[list[Path] | None, typer.Option("--verify", help="public key: serve a private copy of "
                                                           "a repository signed with package --sign, every file "
                                                           "checked (repeatable)")]
    = None,
    openai_port: Annotated[int | None, typer.Option("--openai-port", min=1, max=65535, help="also serve the "
                                                    "OpenAI Images API on this port (127.0.0.1)")] = None,
    api_key: ApiKey = None,
    max_body_bytes: MaxBody = DEFAULT_MAX_BODY,
    allowed_hosts: AllowedHosts = None,
    cors_origins: CorsOrigins = None,
    state_dir: StateDir = None,
    state_max_gb: StateMaxGb = DEFAULT_STATE_MAX_GB,
    job_timeout_s: JobTimeout = DEFAULT_JOB_TIMEOUT_S,
    triton_http: Annotated[bool, typer.Option("--triton-http/--no-triton-http", help="--no-triton-http: start "
                                              "tritonserver without its HTTP and metrics ports, gRPC only (what "
                                              "--openai-port and `generate --url grpc://` use): no port a web page "
                                              "can send requests to but the guarded API (docs/security.md)")] = True,
    memory_budget_gb: Annotated[float | None, typer.Option(
        "--memory-budget-gb", min=0.001, help="refuse to start when the models' estimated memory (recorded by "
        "package) exceeds this host's budget")] = None,
    config: ServingConfig = None,
    replicas: Annotated[int, typer.Option("--replicas", help="tritonservers to start on this host over the "
                                          "repository (the first on the ports above, the others on free ports); "
                                          "with 2 or more, one that exits is restarted on its ports (after 3 quick "
                                          "failures in a row serve stops all and exits 1); --openai-port's API "
                                          "fronts all of them (docs/deploy.md)")] = 1,
):
    """Run tritonserver on the repository (127.0.0.1) until Ctrl-C; with --openai-port, the OpenAI Images API too."""
    from .. import api
    from ..triton.stage import check_replicas

    check_replicas(replicas)  # before anything starts

    openai = None
    if openai_port is not None:
        from ..openai_api.settings import ApiSettings

        openai = ApiSettings(f"127.0.0.1:{grpc_port}", port=openai_port, api_key=api_key,
                             max_body_bytes=max_body_bytes, allowed_hosts=names(allowed_hosts),
                             cors_origins=names(cors_origins), job_timeout_s=job_timeout_s,
                             **state_options(state_dir, state_max_gb), **overload_options(config)).check()
    elif allowed_hosts or cors_origins:
        from ..errors import ServeError

        raise ServeError("--allowed-hosts and --cors-origin guard the OpenAI API: give --openai-port too (Triton's "
                         "own ports stay on 127.0.0.1; see --no-triton-http)")
    elif state_dir is not None:
        from ..errors import ServeError

        raise ServeError("--state-dir is the OpenAI API's job store: give --openai-port too")
    elif config is not None:
        from ..errors import ServeError

        raise ServeError("--config gives the OpenAI API its overload policies: give --openai-port too")

    def announce(ready) -> None:
        reports = ready if isinstance(ready, list) else [ready]
        for index, report in enumerate(reports):
            label = f"replica {index + 1} of {len(reports)}: " if len(reports) > 1 else ""
            console.print(f"{label}ready in {report.seconds_to_ready:.1f} s ({len(report.models_ready)} models, all "
                          "warm)", highlight=False)
            for first in report.first_requests:
                console.print(f"first request at {first.size}: {first.seconds * 1000:.0f} ms ({first.protocol})")
            console.print(f"HTTP  {report.http_url or 'off (--no-triton-http)'}\ngRPC  {report.grpc_url}\n"
                          f"log   {report.log}")
        if openai is not None:
            over = f", over the {len(reports)} replicas" if len(reports) > 1 else ""
            console.print(f"OpenAI  http://{openai.host}:{openai.port}/v1  (images/generations, images/edits, models"
                          + (", Bearer key required" if openai.api_key else "") + over + ")", highlight=False)
        url = reports[0].http_url or f"grpc://{reports[0].grpc_url}"
        console.print(f"try: trt-diffusion generate --url {url} --prompt \"a lighthouse\" -o out.png")
        console.print("Ctrl-C stops the server" + ("s." if len(reports) > 1 else "."))

    console.print(f"starting tritonserver on {repo} …" if replicas == 1
                  else f"starting {replicas} tritonservers on {repo} …")
    if admin_apis:
        console.print("[yellow]note:[/yellow] --admin-apis: shared-memory, trace and logging APIs are open to every "
                      "client that reaches the ports")
    warmup = api.serve(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                       first_request=first_request, on_ready=announce, admin_apis=admin_apis,
                       verify_keys=verify_keys or (), openai=openai, memory_budget_gb=memory_budget_gb,
                       triton_http=triton_http, replicas=replicas)
    console.print("stopped" if warmup else "stopped before the server was ready (tritonserver and its stubs too)")


def generate_command(
    ctx: typer.Context,
    prompt: Annotated[str | None, typer.Option("--prompt", help="what to draw")] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG to write; taken names get OUTPUT-0001.png, "
                                         "... unless --overwrite. A video model writes .mp4 (OUTPUT.png becomes "
                                         "OUTPUT.mp4), or .gif when OUTPUT says .gif")] = Path("out.png"),
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace OUTPUT if it exists")] = False,
    url: Annotated[str, typer.Option("--url", help="the server: HOST:PORT, http://HOST:PORT or grpc://HOST:PORT "
                                     "(the scheme chooses the protocol)")] = "127.0.0.1:8000",
    protocol: Annotated[Transport | None, typer.Option("--protocol", case_sensitive=False,
                                                       help="default: from --url's scheme, else http")] = None,
    config: Annotated[Path | None, typer.Option("--config", help="engines.yaml: run its built engines in this "
                                                "process instead of asking a server")] = None,
    model: Annotated[str | None, typer.Option("--model", help="with --config: the model (default: the only one)")]
    = None,
    target: Annotated[str, typer.Option("--target", help="with --config: whose engines")] = "onnxruntime",
    from_png: Annotated[Path | None, typer.Option("--from", help="repeat the request a PNG of generate (or an "
                                                  "A1111 `parameters` text) records; options given here override")]
    = None,
    pipeline: Annotated[str | None, typer.Option("--pipeline", help="model name; default: the only one")] = None,
    negative_prompt: Annotated[str | None, typer.Option("--negative-prompt")] = None,
    height: Annotated[int | None, typer.Option("--height", help="default: --image's height, else the server's "
                                               "first bucket")] = None,
    width: Annotated[int | None, typer.Option("--width", help="default: --image's width, else the server's first "
                                              "bucket")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1)] = 20,
    guidance_scale: Annotated[float, typer.Option("--guidance-scale", help="<= 1: no CFG (distilled models)")]
    = 7.5,
    seed: Annotated[int, typer.Option("--seed", min=0, max=2**63 - 1, help="0 to 2^63-1 (SEED is INT64)")] = 0,
    scheduler: Annotated[str | None, typer.Option("--scheduler")] = None,
    controlnet: Annotated[str | None, typer.Option("--controlnet")] = None,
    control_image: Annotated[Path | None, typer.Option("--control-image", help="image for the ControlNet")]
    = None,
    controlnet_scale: Annotated[float | None, typer.Option("--controlnet-scale")] = None,
    image: Annotated[Path | None, typer.Option("--image", help="init image (PNG): img2img, or inpaint with --mask; "
                                               "a video model's first frame (img2vid, with --frames). Never "
                                               "resized: its size is the request's, so --width/--height default "
                                               "to it and, if given, must equal it")] = None,
    mask: Annotated[Path | None, typer.Option("--mask", help="inpaint mask (PNG, converted to grayscale; white = "
                                              "repaint), the size of --image")] = None,
    strength: Annotated[float | None, typer.Option("--strength", help="(0, 1]: how far the image is re-noised "
                                                   "(default: img2img 0.8, inpaint 1.0)")] = None,
    workflow: Annotated[str | None, typer.Option("--workflow", help="txt2img | img2img | inpaint | edit | img2vid "
                                                 "(default: what --image and --mask imply; --image with --frames: "
                                                 "img2vid)")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout", help="seconds the whole command may wait for the server "
                                             "(its sizes, connecting, the image)")] = 300.0,
    num_images: Annotated[int, typer.Option("--num-images", min=1, help="images for this prompt, seeds SEED, "
                                            "SEED+1, ...; written as OUTPUT-0.png, OUTPUT-1.png, ... when > 1")] = 1,
    preview: Annotated[Path | None, typer.Option("--preview", help="save live previews in this folder "
                                                    "(gRPC only: the streaming entry <pipeline>_stream)")] = None,
    preview_every: Annotated[int, typer.Option("--preview-every", min=1, help="a preview every N steps")] = 5,
    frames: Annotated[int | None, typer.Option("--frames", min=1, help="a video model's frames (4k+1 for Wan: 5, 9, "
                                               "..., 81); the answer is written as .mp4 (or .gif)")] = None,
    guidance_scale_2: Annotated[float | None, typer.Option("--guidance-scale-2", help="Wan 2.2: the low-noise "
                                                           "expert's guidance (default --guidance-scale)")] = None,
    max_sequence_length: Annotated[int | None, typer.Option(
        "--max-sequence-length", help="Qwen-Image: prompt tokens kept after its template (diffusers' "
        "max_sequence_length; default 512, or the engines' text_length max where lower); longer prompts are "
        "truncated. Other families refuse it")] = None,
    fps: Annotated[int, typer.Option("--fps", min=1, help="a video model's frames per second in the file it "
                                     "writes")] = DEFAULT_FPS,
    lora: Annotated[list[str] | None, typer.Option("--lora", help="NAME[:SCALE] (default scale 1): a LoRA the server "
                                                   "serves (engines.yaml's `mode: refit` LoRAs), applied to this "
                                                   "request only; repeat for several")] = None,
    step_cache: Annotated[str | None, typer.Option(
        "--step-cache", help="on | off: run the model's step cache (engines.yaml step_cache: DeepCache, first-block "
        "caching) or every step whole; default: engines.yaml's step_cache.enabled")] = None,
    family_input: Annotated[list[str] | None, typer.Option(
        "--input", help="NAME=VALUE: a request input the model's family declares ("
        + ", ".join(sorted(request_inputs_of_all())) + "), sent as its Triton input (upper case); repeat for "
        "several; default: diffusers' value. Other families refuse it")] = None,
):
    """Ask a running server (or, with --config, the built engines in this process) for an image; save it as PNG
    with its request in the PNG's text (A1111 `parameters` and JSON); a video model's videos as .mp4 (or .gif)."""
    import time

    from .. import api
    from ..errors import ServeError, TrtDiffusionError
    from ..image_files import ImageParameters, output_paths, read_png_parameters, save_png
    from ..triton.client import ImageRequest
    from ..video_files import save_videos

    given = {name for name in ctx.params if _given(ctx, name)}
    if from_png is not None:  # the PNG's request, under what this command line sets
        recorded = read_png_parameters(from_png)
        prompt = prompt if "prompt" in given else recorded.prompt
        negative_prompt = negative_prompt if "negative_prompt" in given else recorded.negative_prompt
        steps = steps if "steps" in given else recorded.steps
        guidance_scale = guidance_scale if "guidance_scale" in given else recorded.guidance_scale
        seed = seed if "seed" in given else recorded.seed
        scheduler = scheduler if "scheduler" in given else recorded.scheduler
        height = height if "height" in given else recorded.height or None
        width = width if "width" in given else recorded.width or None
        workflow = workflow if "workflow" in given else recorded.workflow
        strength = strength if "strength" in given else recorded.strength
        image = image if "image" in given else _recorded_input("init_image", recorded.init_image, from_png)
        mask = mask if "mask" in given else _recorded_input("mask", recorded.mask, from_png)
    if not prompt:
        ctx.fail("Missing option '--prompt' (what to draw), or --from PNG to repeat an image's request")
    _check_seeds(seed, num_images)
    transport = _transport(url, protocol)
    deadline = _deadline(timeout_s, url) if config is None else None  # one for every call below, from here
    init_image, mask_array = _input_images(image, mask, width, height)
    if init_image is not None:  # the image's size is the request's (never resized)
        height, width = init_image.shape[0], init_image.shape[1]
    if config is None and (height is None or width is None):
        from ..engines_file.engine_spec import Size
        from ..triton.client import served_sizes

        pipeline, sizes = served_sizes(url, pipeline, transport.value, deadline=deadline)
        first = Size.parse(sizes[0])
        height, width = height or first.height, width or first.width
        frames = frames or first.frames or None  # a video server's first bucket: its frames too
    elif config is not None and (height is None or width is None):
        first = api.first_bucket_size(config, model)
        height, width = height or first.height, width or first.width
        frames = frames or first.frames or None
    control = _control_image(control_image, width, height) if control_image is not None else None
    loras = _loras_json(lora, config)
    request = ImageRequest(prompt, height, width, steps, guidance_scale, seed, negative_prompt, scheduler, controlnet,
                           control, controlnet_scale, num_images=num_images if num_images > 1 else None,
                           workflow=workflow, init_image=init_image, mask=mask_array, strength=strength,
                           frames=frames, guidance_scale_2=guidance_scale_2, max_sequence_length=max_sequence_length,
                           loras=loras, step_cache=step_cache, inputs=_family_inputs(family_input))
    start = time.perf_counter()
    on_preview = None
    if config is None and preview is not None:
        if transport is not Transport.grpc or num_images > 1:
            raise ServeError("--preview streams over gRPC, one image at a time: use --url grpc://HOST:8001 and no "
                             "--num-images (HTTP has no streaming in Triton)")
        on_preview = _preview_saver(preview)
    try:
        images, parameters, pipeline = api.generate(request, url=url, protocol=transport.value, pipeline=pipeline,
                                                    timeout_s=timeout_s, config=config, model=model, target=target,
                                                    on_preview=on_preview, preview_every=preview_every,
                                                    deadline=deadline)
    except TrtDiffusionError as err:
        raise _image_size_hint(err, image, init_image) from None
    size = f"{width}x{height}"
    if images.ndim == 5:  # a video model: [N, F, H, W, 3]
        paths = save_videos(images, output, fps, overwrite=overwrite)
        size += f", {images.shape[1]} frames at {fps} fps"
    else:
        paths = output_paths(output, num_images, overwrite=overwrite)
        for i, (path, picture) in enumerate(zip(paths, images)):
            save_png(picture, path, ImageParameters(
                prompt=prompt, width=width, height=height, steps=steps, guidance_scale=guidance_scale, seed=seed + i,
                negative_prompt=negative_prompt, scheduler=scheduler, model=pipeline, controlnet=controlnet,
                controlnet_scale=controlnet_scale, **_workflow_record(workflow, strength, image, mask, path)))
    timing = parameters.get("timing") or {}
    console.print(f"wrote {', '.join(map(str, paths))} ({size}, {steps} steps, seed {seed}) in "
                  f"{time.perf_counter() - start:.2f} s"
                  + (f" (server: {timing.get('total_s', 0):.2f} s, batch {timing.get('batch')})" if timing else ""),
                  soft_wrap=True, highlight=False)


def _loras_json(lora: list[str] | None, config: Path | None) -> str | None:
    """--lora NAME[:SCALE] ... as the LORAS JSON (checked here: a bad one fails before any request)."""
    from ..errors import ConfigError, RuntimeInputError
    from ..triton import lora_sets

    if not lora:
        return None
    if config is not None:
        raise ConfigError("--lora names a LoRA a server serves per request; with --config, apply LoRAs to the engines "
                          "with `trt-diffusion refit --lora FILE[:SCALE]`")
    try:
        return lora_sets.to_json(lora_sets.canonical([lora_sets.parse_cli_lora(text) for text in lora]))
    except RuntimeInputError as err:
        raise ConfigError(str(err)) from None


def _family_inputs(given: list[str] | None) -> dict[str, float] | None:
    """--input NAME=VALUE ... as the request's family inputs (checked here: an unknown name or a value that is not a
    number fails before any request; the model checks the range)."""
    from ..errors import ConfigError

    known = request_inputs_of_all()
    values: dict[str, float] = {}
    for text in given or ():
        name, sep, value = text.partition("=")
        argument = name.strip().lower()
        if not sep or argument not in known:
            raise ConfigError(f"--input {text!r}: expected NAME=VALUE with NAME one of "
                              f"{', '.join(sorted(known)) or 'none'} (a family's declared request input)")
        try:
            values[argument] = known[argument].data_type(value.strip())
        except ValueError:
            raise ConfigError(f"--input {text!r}: {known[argument].name} must be a number") from None
    return values or None


def _given(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def _transport(url: str, protocol: Transport | None) -> Transport:
    """--protocol, else the URL's scheme (grpc:// and grpcs:// mean gRPC), else HTTP."""
    from ..triton.client import parse_url

    scheme = url.partition("://")[0].lower() if "://" in url else ""
    chosen = protocol or (Transport.grpc if scheme in ("grpc", "grpcs") else Transport.http)
    parse_url(url, chosen.value)  # refuses a scheme that contradicts --protocol, with the reason
    return chosen


def _deadline(timeout_s: float, url: str):
    """--timeout as one deadline for the whole command (size discovery, connect, every call)."""
    import math

    from ..errors import ConfigError
    from ..triton.client_limits import Deadline

    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {timeout_s:g}")
    return Deadline(timeout_s, url)


def _check_seeds(seed: int, num_images: int) -> None:
    """Image i is written with seed SEED + i: each must be a seed a request (or the PNG's --from) can send."""
    from ..errors import ConfigError

    last, most = seed + num_images - 1, 2**63 - 1
    if last > most:
        raise ConfigError(f"--seed {seed} with --num-images {num_images} gives seeds up to {last}, beyond {most} "
                          f"(SEED is INT64): use --seed {most - num_images + 1} or less")


def _recorded_input(field: str, name: str | None, png: Path) -> Path | None:
    """An input file a PNG's request names (--from), read only when it lies beside the PNG: a relative name,
    inside the PNG's folder, no symlink on the way. A PNG is data (it may come from anyone): a name it records
    must not make this command read and upload another file of this machine."""
    from ..errors import ConfigError

    if not name:
        return None
    path = Path(name)
    refuse = (f"--from {png}: its request's {field} {name!r} is {{}}; only a file beside the PNG (a relative name "
              f"inside its folder, not a symlink) is read: give --{'image' if field == 'init_image' else 'mask'} "
              "to use another")
    if path.is_absolute():
        raise ConfigError(refuse.format("an absolute path"))
    if ".." in path.parts:
        raise ConfigError(refuse.format("outside the PNG's folder"))
    step = png.parent
    for part in path.parts:  # a link anywhere below the PNG's folder could lead out of it
        step = step / part
        if step.is_symlink():
            raise ConfigError(refuse.format(f"a symlink ({step})"))
    candidate = png.parent / path
    if not candidate.resolve().is_relative_to(png.parent.resolve()):
        raise ConfigError(refuse.format("outside the PNG's folder"))
    if not candidate.is_file():
        raise ConfigError(refuse.format(f"not a file beside it ({candidate})"))
    return candidate


def _input_images(image: Path | None, mask: Path | None, width: int | None, height: int | None):
    """(init image uint8 [H, W, 3], mask uint8 [H, W]) from --image/--mask, each None when not given. Sizes are
    checked here, before any request: the image is the request's size, the mask the image's."""
    from ..errors import ConfigError
    from ..image_files import read_input_image, read_mask

    if image is None:
        if mask is not None:
            raise ConfigError(f"--mask {mask}: a mask needs the --image it masks")
        return None, None
    init_image = read_input_image(image)
    image_h, image_w = init_image.shape[:2]
    if (width is not None and width != image_w) or (height is not None and height != image_h):
        raise ConfigError(f"--image {image} is {image_w}x{image_h}, but --width/--height ask for "
                          f"{width or image_w}x{height or image_h}: images are not resized; leave out "
                          "--width/--height (the image's size is used) or resize the image")
    mask_array = read_mask(mask) if mask is not None else None
    if mask_array is not None and mask_array.shape != init_image.shape[:2]:
        raise ConfigError(f"--mask {mask} is {mask_array.shape[1]}x{mask_array.shape[0]}, --image {image} is "
                          f"{image_w}x{image_h}: the mask must be the image's size")
    return init_image, mask_array


def _image_size_hint(err, image: Path | None, init_image):
    """`err`, saying why an --image request's size is not served when it is not: the image's size is the
    request's (never resized), so the image itself must be a served size (a video model's first frame too)."""
    text = str(err)
    if init_image is None or "is not served; supported sizes" not in text:
        return err
    height, width = init_image.shape[:2]
    hinted = (f"{text}; --image {image} is {width}x{height} and sets the request's size (images are not resized): "
              "resize it to a served width x height")
    try:
        return type(err)(hinted)
    except TypeError:  # an error kind with other arguments: the message as it was
        return err


def _workflow_record(workflow: str | None, strength: float | None, image: Path | None, mask: Path | None,
                     png: Path | None = None) -> dict:
    """What a PNG records of an image-conditioned request: the workflow and strength it ran with, the inputs'
    names: relative to the PNG's folder where they lie in it (what --from reads), else as given. A plain
    text-to-image request records nothing new (its PNG reads as before)."""
    from ..workflows import DEFAULT_STRENGTH, request_workflow

    if image is None and workflow is None:
        return {}
    resolved = request_workflow(workflow, image is not None, mask is not None)
    if strength is None and resolved.takes_strength:
        strength = DEFAULT_STRENGTH.get(resolved)
    return {"workflow": resolved.value, "strength": strength if resolved.takes_strength else None,
            "init_image": _input_name(image, png), "mask": _input_name(mask, png)}


def _input_name(path: Path | None, png: Path | None) -> str | None:
    """An input's name as the PNG records it: relative to the PNG's folder when inside it, else as given."""
    import os

    if path is None:
        return None
    if png is not None:
        folder = Path(png).parent.resolve()
        resolved = Path(path).resolve()
        if resolved.is_relative_to(folder):
            return os.path.relpath(resolved, folder)
    return str(path)


def _control_image(path: Path, width: int, height: int):
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    from ..errors import ConfigError

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB").resize((width, height)), dtype=np.uint8)
    except FileNotFoundError:
        raise ConfigError(f"--control-image {path}: no such file") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise ConfigError(f"--control-image {path}: not a readable image ({exc})") from None


def _preview_saver(preview: Path):
    """`on_preview(step, image)` for a streamed request: each preview saved in the folder, and said."""
    import numpy as np
    from PIL import Image

    preview.mkdir(parents=True, exist_ok=True)

    def save(step: int, picture) -> None:
        if picture.ndim == 4:  # a video's preview, one per latent frame [f, h, w, 3]: side by side in one PNG
            picture = np.concatenate(list(picture), axis=1)
        Image.fromarray(picture).save(preview / f"step-{step:04d}.png")
        console.print(f"preview {preview / f'step-{step:04d}.png'}", soft_wrap=True, highlight=False)

    return save


COMMANDS = {"package": package_command, "serve": serve_command, "generate": generate_command}
