"""The serving commands: package (a Triton model repository), serve (tritonserver on it), generate (ask it)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..targets import check_target_name, target_names
from .console import console
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
    model: Annotated[str | None, typer.Option("--model", help="the model of engines.yaml to package")] = None,
    target: Annotated[str, typer.Option("--target", help="which built engines to serve: "
                                        f"{' | '.join(target_names())}")] = "onnxruntime",
    engine_backend: Annotated[EngineBackend, typer.Option(
        "--engine-backend", help="python: the target's runner inside python-backend models (runs on the "
        "tritonserver bundled in nvidia-pytriton); native: the target's own Triton backend (onnxruntime, "
        "openvino: NVIDIA's containers). tensorrt engines are always served as tensorrt_plan")]
    = EngineBackend.python,
    instances: Annotated[int, typer.Option("--instances", min=1, help="instances of the pipeline (denoise) models;"
                                           " 2 avoids a 500 ms stall of Triton 2.51's batcher with one")] = 2,
    engine_instances: Annotated[int, typer.Option("--engine-instances", min=1, help="instances per engine model")]
    = 1,
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
                                                  "batch partners (0 where the engines are batch 1 only)")] = 5.0,
    max_images: Annotated[int, typer.Option("--max-images", min=1, help="NUM_IMAGES of one request at most")] = 8,
    stream: Annotated[bool, typer.Option("--stream/--no-stream",
                                         help="also write <pipeline>_stream (gRPC streaming, previews)")] = True,
):
    """Write a Triton model repository serving the built engines of one model."""
    from ..triton.repository import PackageOptions
    from ..triton.stage import package_stage

    options = PackageOptions(engine_backend=engine_backend.value, pipeline_instances=instances,
                             engine_instances=engine_instances, max_queue_size=max_queue_size,
                             queue_timeout_s=queue_timeout_s, warmup_data=warmup_data.value, ensemble=ensemble,
                             batch_requests=batch_requests, batch_delay_ms=batch_delay_ms, max_images=max_images,
                             stream=stream)
    report = package_stage(config, out, check_target_name(target), model=model, options=options)
    table = Table(title=f"Triton repository {report.repo}")
    for column in ("model", "role", "backend", "component", "bucket", "batch", "warm-up shapes"):
        table.add_column(column)
    for m in report.models:
        batch = "" if m.batch is None else str(m.batch)
        warmups = str(m.warmup_samples) if m.role == "engine" else ""
        table.add_row(m.name, m.role, m.backend, m.component or "", m.bucket or "", batch, warmups)
    console.print(table)
    console.print(f"public entry: [bold]{report.entry}[/bold]" + (f" (and the ensemble {report.ensemble})"
                                                                   if report.ensemble else "")
                  + f"; sizes: {', '.join(report.sizes)}; written in {report.seconds:.1f} s")
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print(f"next: trt-diffusion serve --repo {out}")


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
):
    """Run tritonserver on the repository (127.0.0.1) until Ctrl-C."""
    from ..triton.stage import serve

    def announce(report) -> None:
        console.print(f"ready in {report.seconds_to_ready:.1f} s ({len(report.models_ready)} models, all warm)")
        for first in report.first_requests:
            console.print(f"first request at {first.size}: {first.seconds * 1000:.0f} ms ({first.protocol})")
        console.print(f"HTTP  {report.http_url}\ngRPC  {report.grpc_url}\nlog   {report.log}")
        console.print(f"try: trt-diffusion generate --url {report.http_url} --prompt \"a lighthouse\" -o out.png")
        console.print("Ctrl-C stops the server.")

    console.print(f"starting tritonserver on {repo} …")
    if admin_apis:
        console.print("[yellow]note:[/yellow] --admin-apis: shared-memory, trace and logging APIs are open to every "
                      "client that reaches the ports")
    warmup = serve(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                   first_request=first_request, on_ready=announce, admin_apis=admin_apis)
    console.print("stopped" if warmup else "stopped before the server was ready (tritonserver and its stubs too)")


def generate_command(
    prompt: Annotated[str, typer.Option("--prompt", help="what to draw")],
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG to write")] = Path("out.png"),
    url: Annotated[str, typer.Option("--url", help="HOST:PORT of the server's HTTP or gRPC endpoint")]
    = "127.0.0.1:8000",
    protocol: Annotated[Transport, typer.Option("--protocol", case_sensitive=False)] = Transport.http,
    pipeline: Annotated[str | None, typer.Option("--pipeline", help="model name; default: the only one")] = None,
    negative_prompt: Annotated[str | None, typer.Option("--negative-prompt")] = None,
    height: Annotated[int | None, typer.Option("--height", help="default: the server's first bucket")] = None,
    width: Annotated[int | None, typer.Option("--width", help="default: the server's first bucket")] = None,
    steps: Annotated[int, typer.Option("--steps")] = 20,
    guidance_scale: Annotated[float, typer.Option("--guidance-scale")] = 7.5,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    scheduler: Annotated[str | None, typer.Option("--scheduler")] = None,
    controlnet: Annotated[str | None, typer.Option("--controlnet")] = None,
    control_image: Annotated[Path | None, typer.Option("--control-image", help="image for the ControlNet")]
    = None,
    controlnet_scale: Annotated[float | None, typer.Option("--controlnet-scale")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout", help="seconds to wait for the image")] = 300.0,
    num_images: Annotated[int, typer.Option("--num-images", min=1, help="images for this prompt, seeds SEED, "
                                            "SEED+1, ...; written as OUTPUT-0.png, OUTPUT-1.png, ... when > 1")] = 1,
    preview: Annotated[Path | None, typer.Option("--preview", help="save live previews in this folder "
                                                    "(gRPC only: the streaming entry <pipeline>_stream)")] = None,
    preview_every: Annotated[int, typer.Option("--preview-every", min=1, help="a preview every N steps")] = 5,
):
    """Ask a running server for one image (or --num-images N) and save it as PNG."""
    import time

    import numpy as np
    from PIL import Image

    from ..engines_file.engine_spec import Size
    from ..triton.client import ImageRequest, generate_images, served_sizes, stream

    if height is None or width is None:
        pipeline, sizes = served_sizes(url, pipeline, protocol.value)
        first = Size.parse(sizes[0])
        height, width = height or first.height, width or first.width
    control = None
    if control_image is not None:
        control = np.asarray(Image.open(control_image).convert("RGB").resize((width, height)), dtype=np.uint8)
    from ..errors import ServeError as _UserError

    request = ImageRequest(prompt, height, width, steps, guidance_scale, seed, negative_prompt, scheduler, controlnet,
                           control, controlnet_scale, num_images=num_images if num_images > 1 else None)
    start = time.perf_counter()
    output.parent.mkdir(parents=True, exist_ok=True)
    if preview is not None:
        if protocol is not Transport.grpc or num_images > 1:
            raise _UserError("--preview streams over gRPC, one image at a time: use --protocol grpc with the gRPC "
                             "port (8001) and no --num-images (HTTP has no streaming in Triton)")
        preview.mkdir(parents=True, exist_ok=True)

        def save(step: int, picture) -> None:
            Image.fromarray(picture).save(preview / f"step-{step:04d}.png")
            console.print(f"preview {preview / f'step-{step:04d}.png'}")

        if pipeline is None:
            from ..triton.client import connect, find_pipeline

            client = connect(url, "grpc", 60.0)
            try:
                pipeline = find_pipeline(client, url)
            finally:
                client.close()
        image, _, parameters = stream(url, request, model=f"{pipeline}_stream", preview_every=preview_every,
                                      timeout_s=timeout_s, on_preview=save)
        images = image[None]
    else:
        images, parameters = generate_images(url, request, pipeline=pipeline, protocol=protocol.value,
                                             timeout_s=timeout_s)
    paths = [output] if len(images) == 1 else [output.with_name(f"{output.stem}-{i}{output.suffix}")
                                                for i in range(len(images))]
    for path, image in zip(paths, images):
        Image.fromarray(image).save(path)
    timing = parameters.get("timing") or {}
    console.print(f"wrote {', '.join(map(str, paths))} ({width}x{height}, {steps} steps, seed {seed}) in "
                  f"{time.perf_counter() - start:.2f} s"
                  + (f" (server: {timing.get('total_s', 0):.2f} s, batch {timing.get('batch')})" if timing else ""))


COMMANDS = {"package": package_command, "serve": serve_command, "generate": generate_command}
