"""The full-size Wan 2.1 1.3B transformer (1,418,996,800 parameters, random weights) on this CPU.

Two measurements, each in its own process so a peak belongs to that step alone:

1. `--step export`: `api.export` of the transformer at 832x480x17 (480p, 17 frames: 5 latent frames, 7,800 image
   tokens): wall time per stage and the peak resident memory of the whole process tree over the fp32 weights
   (the issue's bound: 1.5x);
2. `--step routes`: one transformer call (batch 1: CFG runs as two such calls) at 832x480x5 (2 latent frames,
   3,120 tokens) on every CPU route — PyTorch fp32 eager, PyTorch bf16 autocast (AMX/AVX512-BF16 hosts only),
   the project's onnxruntime fp32 and openvino fp32/bf16 engines built from the project's export — interleaved
   rounds, median of `--runs` (3: a PyTorch call is tens of seconds here), the speed-up over PyTorch fp32 and the
   output PSNR against it (bench_cpu.py's `measure`).

Needs about 6 GB of disk for the model, 6 GB per exported ONNX, ~16 GB of memory, and most of an hour on two
cores. Usage: `python scripts/bench_video.py [--workdir build/bench-video] [--runs 3] [--json out.json]`
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench_cpu import Route, log, measure
from tree_memory import GIB, RssSampler, fp32_weight_bytes, run_step

from trt_diffusion.workspace.provenance import cpu_name

EXPORT_BUCKET = "832x480x17"
ROUTES_BUCKET = "832x480x5"


def full_model(workdir: Path) -> Path:
    from trt_diffusion.models.tiny import write_tiny_model

    folder = workdir / "wan-full"
    if not (folder / "model_index.json").is_file():
        log("writing the full-size wan folder (the 1.3B transformer, random weights)")
        write_tiny_model(folder, "wan", size="full")
    return folder


def engines_yaml(workdir: Path, model_dir: Path, bucket: str, targets: list[str]) -> Path:
    path = workdir / f"engines-{bucket}.yaml"
    path.write_text(
        "version: 1\n"
        f"build: {{workspace: {workdir / 'build'}}}\n"
        "models:\n"
        "  wan:\n"
        f"    source: {model_dir}\n"
        "    family: wan\n"
        "    components: [transformer]\n"
        f"    buckets: ['{bucket}']\n"
        "    batch: [1]\n"
        "    cfg: split\n"
        f"    targets: [{', '.join(targets)}]\n"
        "    precision: {transformer: fp32}\n")
    return path


def step_export(workdir: Path) -> dict:
    from trt_diffusion import api

    model_dir = full_model(workdir)
    config = engines_yaml(workdir, model_dir, EXPORT_BUCKET, ["onnxruntime"])
    with RssSampler() as sampler:
        sampler.mark("import")
        started = time.perf_counter()
        report = api.export(config, progress=lambda event: sampler.mark(event.stage))
        total_s = time.perf_counter() - started
    (result,) = report.results
    weights = fp32_weight_bytes(model_dir, "transformer")
    peak = max(rss for rss, _ in sampler.peaks.values())
    return {"bucket": EXPORT_BUCKET, "cached": result.cached, "total_s": round(total_s, 1),
            "timings_s": result.artifact.manifest.get("timings", {}), "fp32_weights_gb": round(weights / GIB, 2),
            "peak_rss_gb": round(peak / GIB, 2), "peak_over_fp32_weights": round(peak / weights, 2),
            "stages": {stage: sampler.report(stage) for stage in ("hashing", "reference", "exporting", "cleaning",
                                                                  "parity")},
            "max_rel_error": result.max_rel_error}


def step_routes(workdir: Path, runs: int) -> dict:
    import numpy as np

    from trt_diffusion import api
    from trt_diffusion.components import Geometry, get_component, load_model_config
    from trt_diffusion.engines_file import Size, load_engines_file
    from trt_diffusion.families import Component
    from trt_diffusion.models.loading import load_component
    from trt_diffusion.runtime.loader import built_engines, runner_for
    from trt_diffusion.targets.openvino import host, precision

    model_dir = full_model(workdir)
    definition = get_component("wan", "transformer")
    model_config = load_model_config(model_dir, "wan", "transformer")
    feeds = definition.dummy_inputs(model_config, {}, Geometry(1, Size.parse(ROUTES_BUCKET)))
    names = definition.io(model_config, {}).input_names

    def torch_route(bf16: bool):
        def load():
            import torch

            wrapper = definition.wrapper(load_component(model_dir, Component.transformer), model_config, {})

            def run(f):
                with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                    return wrapper(*[torch.from_numpy(f[n]) for n in names]).float().numpy()
            return run
        return load

    def engine_route(target: str, engine_precision: str):
        config = engines_yaml(workdir, model_dir, ROUTES_BUCKET, [target])
        text = config.read_text().replace("{transformer: fp32}", f"{{transformer: {engine_precision}}}")
        config = config.with_name(f"engines-{target}-{engine_precision}.yaml")
        config.write_text(text)

        def load():
            report = api.build(config, target=target)
            if report.failed:
                raise RuntimeError(report.failed[0].error)
            (engine,) = built_engines(load_engines_file(config, check_sources=True), "wan", target)
            runner = runner_for(engine)
            return lambda f: runner.run(f)["noise_pred"]
        return load

    def refusal(name: str) -> str | None:
        try:
            precision.resolve(name, host.cpu_facts().capabilities, host.cpu_facts().device_name)
        except Exception as exc:  # noqa: BLE001 - the target's own words for why this CPU cannot
            return str(exc)[:160]
        return None

    bf16_reason = None if "BF16" in host.cpu_facts().capabilities else "no bf16 hardware (AMX/AVX512-BF16)"
    routes = [Route("pytorch fp32", torch_route(False)), Route("pytorch bf16 autocast", torch_route(True), bf16_reason),
              Route("onnxruntime fp32 (project)", engine_route("onnxruntime", "fp32")),
              Route("openvino fp32 (project)", engine_route("openvino", "fp32")),
              Route("openvino bf16 (project)", engine_route("openvino", "bf16"), refusal("bf16"))]
    for route in routes[2:]:  # build (and export) outside the timed rounds
        if not route.unavailable:
            log(f"building {route.name}")
            route.load()
    rows = measure(routes, feeds, runs)
    return {"bucket": ROUTES_BUCKET, "tokens": int(np.prod(feeds["hidden_states"].shape[2:]) // 4), "runs": runs,
            "routes": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("build/bench-video"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--only", choices=["export", "routes"], help="one measurement")
    parser.add_argument("--step", choices=["export", "routes"], help=argparse.SUPPRESS)  # child processes
    args = parser.parse_args()
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if args.step == "export":
        print(json.dumps(step_export(workdir)))
        return
    if args.step == "routes":
        print(json.dumps(step_routes(workdir, args.runs)))
        return
    full_model(workdir)
    figures = {"cpu": cpu_name(), "python": sys.version.split()[0]}
    for step in [args.only] if args.only else ["export", "routes"]:
        log(f"step {step} (a fresh process)")
        figures[step] = run_step(__file__, ["--step", step, "--workdir", str(workdir), "--runs", str(args.runs)],
                                 live_stderr=True)
        log(json.dumps(figures[step], indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
