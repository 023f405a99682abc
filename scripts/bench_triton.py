"""What Triton costs: the same engines in process and behind the server, per request and per denoise step.

Builds (or reuses) the onnxruntime engines of a tiny sd15 model, packages them, starts the bundled tritonserver
on 127.0.0.1, then times requests of several step counts both ways. Latency is fitted as a + b·steps:
`a` is the fixed cost of a request (text encoders, VAE, transport), `b` the cost of one denoise step (one
CFG-batched UNet call, through BLS when served). Server minus in-process gives Triton's overhead.

    python scripts/bench_triton.py [--workdir build/bench-triton] [--runs 7] [--steps 2 10 30] [--json out.json]

The tiny model's engines take milliseconds, so the overhead shows clearly; on real models it is the same
absolute cost next to much longer engine calls. Needs no GPU and no network.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import yaml

MODEL = "sd15-tiny"
SIZE = 64


def prepare_repository(workdir: Path, *, instances: int = 2, max_queue_size: int = 8, queue_timeout_s: float = 30.0,
                       ensemble: bool = True):
    """Tiny sd15 model -> engines (cached by the build stage) -> Triton repository. Returns
    (engines.yaml, PackageReport, built engines, model folder)."""
    from trt_diffusion import api
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.models.tiny import write_tiny_model
    from trt_diffusion.runtime.loader import built_engines
    from trt_diffusion.triton.repository import PackageOptions, package

    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / "sd15-tiny-model"
    if not (model_dir / "model_index.json").is_file():
        write_tiny_model(model_dir, "sd15", overwrite=True)
    config_path = workdir / "engines.yaml"
    config_path.write_text(yaml.safe_dump({
        "version": 1, "build": {"workspace": "build"},
        "models": {MODEL: {"source": str(model_dir.resolve()), "family": "sd15", "buckets": [f"{SIZE}x{SIZE}"],
                           "batch": [1], "targets": ["onnxruntime"]}}}, sort_keys=False))
    api.build(config_path, target="onnxruntime")
    engines = built_engines(load_engines_file(config_path, check_sources=True), MODEL, "onnxruntime")
    options = PackageOptions(pipeline_instances=instances, max_queue_size=max_queue_size,
                             queue_timeout_s=queue_timeout_s, ensemble=ensemble)
    report = package(engines, model_dir, "sd15", MODEL, workdir / "triton_repo", options)
    return config_path, report, engines, model_dir


def fit(steps: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least squares a + b·steps over the medians."""
    slope, intercept = np.polyfit(np.array(steps, float), np.array(seconds, float), 1)
    return float(intercept), float(slope)


class LocalTarget:
    """The in-process pipeline over the same engines."""

    def __init__(self, engines, model_dir: Path):
        from trt_diffusion.runtime.loader import table_from_engines
        from trt_diffusion.runtime.pipeline import EnginePipeline

        self.pipeline = EnginePipeline(model_dir, "sd15", table_from_engines(engines))

    def __call__(self, steps: int) -> np.ndarray:
        from trt_diffusion.runtime.pipeline import GenerationRequest

        request = GenerationRequest(prompt="a lighthouse", height=SIZE, width=SIZE, steps=steps, seed=1)
        return self.pipeline.generate(request).images[0]

    def close(self) -> None:
        pass


class ServerTarget:
    """One open client to one model of the server."""

    def __init__(self, url: str, protocol: str, model: str):
        from trt_diffusion.triton.client import client_module, connect

        self.url, self.protocol, self.model = url, protocol, model
        self.module = client_module(protocol)
        self.client = connect(url, protocol)

    def __call__(self, steps: int) -> np.ndarray:
        from trt_diffusion.triton.client import ImageRequest, infer

        request = ImageRequest("a lighthouse", SIZE, SIZE, steps=steps, seed=1)
        return infer(self.client, self.module, self.model, request, protocol=self.protocol, timeout_s=120,
                     url=self.url)

    def close(self) -> None:
        self.client.close()


def time_targets(targets: dict, step_counts: list[int], runs: int) -> dict[str, dict[int, list[float]]]:
    """Seconds per (target, steps), `runs` samples each. Runs are interleaved across targets, so a change in
    the machine's load during the benchmark touches every target alike."""
    samples = {name: {s: [] for s in step_counts} for name in targets}
    for run in range(runs + 1):  # run 0 warms every path and is dropped
        for steps in step_counts:
            for name, target in targets.items():
                start = time.perf_counter()
                target(steps)
                if run:
                    samples[name][steps].append(time.perf_counter() - start)
    return samples


def overhead_arguments(description: str, argv: list[str] | None) -> argparse.Namespace:
    """The options of the benches that fit a + b·steps (this one, bench_openai_api.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workdir", type=Path, default=Path("build/bench-triton"))
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 10, 30])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if len(args.steps) < 2:
        parser.error("--steps needs at least two step counts to separate per-request from per-step cost")
    return args


def main(argv: list[str] | None = None) -> int:
    args = overhead_arguments(__doc__.splitlines()[0], argv)

    from trt_diffusion.triton.stage import start

    start_time = time.perf_counter()
    _, report, engines, model_dir = prepare_repository(args.workdir)
    print(f"engines and repository ready in {time.perf_counter() - start_time:.1f} s", file=sys.stderr)
    server, warmup = start(report.repo, work_dir=args.workdir / "server", first_request=True)
    targets = {"in-process": LocalTarget(engines, model_dir)}
    try:
        targets["server grpc entry"] = ServerTarget(server.grpc_url, "grpc", report.entry)
        targets["server http entry"] = ServerTarget(server.http_url, "http", report.entry)
        targets["server grpc ensemble"] = ServerTarget(server.grpc_url, "grpc", report.ensemble)
        rows = time_targets(targets, args.steps, args.runs)
        local_image, served_image = targets["in-process"](4), targets["server grpc entry"](4)
        ensemble_image = targets["server grpc ensemble"](4)
    finally:
        for target in targets.values():
            target.close()
        server.stop()

    # Best-of-N is the figure least touched by other processes on a shared machine; medians are shown too.
    statistics_ = {"best": min, "median": statistics.median}
    table = {kind: {name: {s: reduce(v) for s, v in by_steps.items()} for name, by_steps in rows.items()}
             for kind, reduce in statistics_.items()}
    fits = {kind: {name: fit(args.steps, [values[s] for s in args.steps]) for name, values in by_name.items()}
            for kind, by_name in table.items()}
    print(f"\nsd15 tiny {SIZE}x{SIZE}, CFG batched, {args.runs} interleaved runs; fit: seconds = a + b*steps; "
          "overhead = server - in-process")
    for kind in statistics_:
        base_request, base_step = fits[kind]["in-process"]
        print(f"\n[{kind}]{'':17}" + "".join(f"{f'{s} steps':>10}" for s in args.steps)
              + f"{'a ms':>8}{'b ms/step':>11}{'+a ms':>8}{'+b ms/step':>12}")
        for name, values in table[kind].items():
            request_cost, step_cost = fits[kind][name]
            line = f"{name:24}" + "".join(f"{values[s] * 1000:>8.1f}ms" for s in args.steps)
            line += f"{request_cost * 1000:>8.1f}{step_cost * 1000:>11.2f}"
            if name != "in-process":
                line += f"{(request_cost - base_request) * 1000:>8.1f}{(step_cost - base_step) * 1000:>12.2f}"
            print(line)
    identical = bool(np.array_equal(local_image, served_image) and np.array_equal(local_image, ensemble_image))
    print(f"\nserver ready in {warmup.seconds_to_ready:.1f} s; first request "
          f"{warmup.first_requests[0].seconds * 1000:.1f} ms; served images (entry, ensemble) bit-identical to "
          f"in-process: {identical}")
    if args.json:
        args.json.write_text(json.dumps({
            "size": SIZE, "runs": args.runs, "steps": args.steps,
            "samples_s": {name: {str(s): v for s, v in by_steps.items()} for name, by_steps in rows.items()},
            "fit": {kind: {name: {"per_request_s": a, "per_step_s": b} for name, (a, b) in by_name.items()}
                    for kind, by_name in fits.items()},
            "seconds_to_ready": warmup.seconds_to_ready, "first_request_s": warmup.first_requests[0].seconds,
            "bit_identical": identical}, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
