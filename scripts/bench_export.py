"""Benchmark the export of a full-size SD1.5 UNet (860M parameters, random weights).

Measures, each step in its own process so peak RSS belongs to that step alone:

1. `api.export` of the UNet (dynamo=True, optimize=False): wall time per stage (hash, load, PyTorch
   reference outputs, torch.onnx.export, graph passes, ONNX Runtime parity) and the resident memory of the
   whole process tree (the export process and any children it starts), sampled every 50 ms: at the start
   and peak of each stage, the peak over the whole call, and that peak over the fp32 weights' size;
2. one UNet call at batch 2 on 32x32 latents (256x256 pixels): PyTorch eager vs ONNX Runtime, median of
   a few runs after a warm-up, and their ratio.

Needs ~4 GB of disk for the model folder, ~4 GB for the ONNX, ~6 GB of memory, and a few minutes of
two cores. Usage: `python scripts/bench_export.py [--workdir build/bench] [--runs 3] [--no-latency] [--json out.json]`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
from tree_memory import GIB, RssSampler, fp32_weight_bytes, run_step

LATENT = 32  # 32x32 latents = 256x256 pixels
BATCH = 2  # one classifier-free-guidance step


def write_engines_yaml(workdir: Path, model_dir: Path) -> Path:
    config = workdir / "engines.yaml"
    config.write_text(
        "version: 1\n"
        "build: {workspace: build, opset: 20}\n"
        "models:\n"
        f"  {model_dir.name}:\n"
        f"    source: {model_dir}\n"
        "    family: sd15\n"
        "    components: [unet]\n"
        f"    buckets: ['{LATENT * 8}x{LATENT * 8}']\n"
        "    batch: [1]\n"
        "    cfg: batched\n"
        "    targets: [onnxruntime]\n"
        "    precision: {unet: fp32}\n"
    )
    return config


def measure_export(config: Path, model_dir: Path) -> dict:
    from trt_diffusion import api

    with RssSampler() as sampler:
        sampler.mark("import")
        started = time.perf_counter()
        report = api.export(config, progress=lambda event: sampler.mark(event.stage))
        total_s = time.perf_counter() - started
    (result,) = report.results
    manifest = result.artifact.manifest
    import resource

    weights = fp32_weight_bytes(model_dir)
    peak = max(rss for rss, _ in sampler.peaks.values())
    return {
        "onnx": str(result.onnx_path), "cached": result.cached, "total_s": round(total_s, 1),
        "timings_s": manifest.get("timings", {}),
        "fp32_weights_gb": round(weights / GIB, 2),
        "memory": {  # whole process tree
            "hashing_and_load": sampler.report("hashing"),  # the module is loaded at the end of this stage
            "reference_outputs": sampler.report("reference"),  # PyTorch at the parity shapes, module loaded
            "torch_onnx_export": sampler.report("exporting"),
            "graph_passes": sampler.report("cleaning"),  # torch module freed by now
            "parity": sampler.report("parity"),  # the ONNX Runtime session against stored PyTorch outputs
            "peak_rss_gb": round(peak / GIB, 2),
            "peak_over_fp32_weights": round(peak / weights, 2) if weights else None,
            "self_ru_maxrss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2),
            "children_ru_maxrss_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB, 2),
        },
        "onnx_bytes": sum(o["bytes"] for o in manifest["outputs"]),
        "max_rel_error": result.max_rel_error,
    }


def measure_latency(model_dir: Path, onnx_path: Path, runs: int) -> dict:
    import numpy as np
    import onnxruntime as ort
    import torch

    from trt_diffusion.components import Geometry, get_component, load_model_config
    from trt_diffusion.engines_file import Size
    from trt_diffusion.families import Component
    from trt_diffusion.models.loading import load_component

    definition = get_component("sd15", "unet")
    config = load_model_config(model_dir, "sd15", "unet")
    feeds = definition.dummy_inputs(config, {}, Geometry(BATCH, Size(LATENT * 8, LATENT * 8)))
    wrapper = definition.wrapper(load_component(model_dir, Component.unet), config, {})
    tensors = [torch.from_numpy(feeds[name]) for name in definition.io(config, {}).input_names]

    def torch_call():
        with torch.inference_mode():
            return wrapper(*tensors).numpy()

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    started = time.perf_counter()
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    session_s = time.perf_counter() - started

    def ort_call():
        return session.run(None, feeds)[0]

    def timed(call) -> tuple[float, np.ndarray]:
        output = call()  # warm-up
        samples = []
        for _ in range(runs):
            tick = time.perf_counter()
            call()
            samples.append(time.perf_counter() - tick)
        return statistics.median(samples), output

    torch_s, reference = timed(torch_call)
    ort_s, candidate = timed(ort_call)
    return {"batch": BATCH, "latent": f"{LATENT}x{LATENT}", "runs": runs, "torch_s": round(torch_s, 3),
            "ort_s": round(ort_s, 3), "ort_speedup": round(torch_s / ort_s, 2), "ort_session_s": round(session_s, 1),
            "max_abs_diff": float(np.abs(reference - candidate).max()), "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("build/bench"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--size", choices=["full", "tiny"], default="full", help="tiny: a quick check of this script")
    parser.add_argument("--no-latency", action="store_true", help="skip the PyTorch vs ONNX Runtime timing")
    parser.add_argument("--step", choices=["export", "latency"], help=argparse.SUPPRESS)  # child processes
    parser.add_argument("--onnx", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = args.workdir.resolve()
    model_dir = workdir / f"sd15-{args.size}"

    if args.step == "export":
        sys.stdout.write(json.dumps(measure_export(write_engines_yaml(workdir, model_dir), model_dir)) + "\n")
        return
    if args.step == "latency":
        sys.stdout.write(json.dumps(measure_latency(model_dir, args.onnx, args.runs)) + "\n")
        return

    from rich.console import Console

    console = Console()
    workdir.mkdir(parents=True, exist_ok=True)
    if not (model_dir / "model_index.json").is_file():
        console.print(f"writing the {args.size} SD1.5 pipeline (random weights) to {model_dir} ...")
        subprocess.run([sys.executable, "-m", "trt_diffusion", "models", "tiny", "--family", "sd15", "--size", args.size,
                        "--out", str(model_dir), "--if-missing"], check=True)
    console.print("exporting the UNet (own process) ...")
    export = run_step(__file__, ["--workdir", str(workdir), "--size", args.size, "--step", "export"])
    latency = None
    if not args.no_latency:
        console.print("timing one UNet call, PyTorch vs ONNX Runtime (own process) ...")
        latency = run_step(__file__, ["--workdir", str(workdir), "--size", args.size, "--step", "latency",
                                      "--onnx", export["onnx"], "--runs", str(args.runs)])
    figures = {"machine": {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / GIB, 1)},
               "export": export, "latency": latency}
    console.print_json(json.dumps(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
