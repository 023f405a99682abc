"""Benchmark the quantize stage.

1. Tiny seeded models (sd15, sdxl, sd3, flux) x (int8, fp8): wall time of `quantize_component` and the gate's
   figures (worst held-out denoiser-output PSNR, worst image PSNR / SSIM against the fp32 pipeline).
2. `--full`: the full-size UNet architectures (random weights; `--family sd15` 860M parameters, `--family sdxl`
   2.6B), each quantization in its own process: wall time per step (load, calibration, Q/DQ export, gate) and
   the resident memory of the whole process tree per step, its peak, and that peak over the fp32 weights.
   `--recipe default` runs engines.yaml's default calibration (8 prompts x 4 steps at 256x256) and gate (2
   held-out generations, images compared): what `build` does. `--runs N`: ONNX Runtime CPU latency of the
   sd15 Q/DQ graph against an fp32 graph from the same (legacy) exporter, batch 2, 32x32 latents, N
   interleaved runs after a warm-up, median.

    python scripts/bench_quantize.py [--full [--family sd15 --family sdxl] [--precision int8]] [--json out.json]

Prints a table and (with --json) writes the numbers. Needs no GPU and no network.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from tree_memory import run_step

TINY_BUCKET = {"sd15": "64x64", "sdxl": "64x64", "sd3": "128x128", "flux": "128x128"}
DENOISER = {"sd15": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer"}


def _config(root: Path, name: str, model_dir: Path, family: str, precision: str, bucket: str,
            calibration: dict) -> Path:
    path = root / f"{name}.yaml"
    entry = {"source": str(model_dir), "family": family, "components": [DENOISER[family]],
             "precision": {DENOISER[family]: precision}, "buckets": [bucket],
             "quantization": {"calibration": calibration}}
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build"}, "models": {name: entry}}))
    return path


def bench_tiny(root: Path) -> list[dict]:
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.models.tiny import write_tiny_model
    from trt_diffusion.quantize.stage import quantize_component

    rows = []
    for family in ("sd15", "sdxl", "sd3", "flux"):
        model_dir = write_tiny_model(root / family, family, overwrite=True)
        for precision in ("int8", "fp8"):
            path = _config(root, f"{family}-{precision}", model_dir, family, precision, TINY_BUCKET[family],
                           {"samples": 4, "steps": 4, "seed": 0})
            model = load_engines_file(path).models[f"{family}-{precision}"]
            started = time.perf_counter()
            artifact = quantize_component(model, DENOISER[family], precision, None, root / "build", force=True)
            seconds = time.perf_counter() - started
            gate = artifact.gate
            rows.append({"family": family, "precision": precision, "seconds": round(seconds, 2),
                         "layers": len(artifact.manifest["quantized_layers"]),
                         "excluded": len(artifact.manifest["excluded_layers"]),
                         "output_psnr_db_min": round(gate["output_psnr_db_min"], 2),
                         "image_psnr_db_min": round(gate["image_psnr_db_min"], 2),
                         "image_ssim_min": round(gate["image_ssim_min"], 4),
                         "timings_s": artifact.manifest["timings_s"]})
            print(f"  {family:5s} {precision:4s} {seconds:6.1f} s  layers {rows[-1]['layers']:3d}  "
                  f"output PSNR {rows[-1]['output_psnr_db_min']:6.2f} dB  image PSNR "
                  f"{rows[-1]['image_psnr_db_min']:6.2f} dB  SSIM {rows[-1]['image_ssim_min']:.4f}", flush=True)
    return rows


def _session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # Spinning worker threads collapse when the cores are shared (CI runners, other jobs): measure without.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _latencies(sessions: dict, feeds: dict, runs: int) -> dict[str, float]:
    """Median latency per session, runs interleaved (A B A B ...) so both see the same machine load.

    One warm-up each first (first-run allocations and kernel selection).
    """
    for session in sessions.values():
        session.run(None, feeds)
    times: dict[str, list[float]] = {label: [] for label in sessions}
    for _ in range(runs):
        for label, session in sessions.items():
            started = time.perf_counter()
            session.run(None, feeds)
            times[label].append(time.perf_counter() - started)
    return {label: statistics.median(values) for label, values in times.items()}


FULL_RECIPES = {  # calibration (prompts x steps) and held-out generations of the gate
    "default": ({"samples": 8, "steps": 4, "seed": 0}, 2, True),  # engines.yaml's defaults: what `build` runs
    "quick": ({"samples": 2, "steps": 1, "seed": 0}, 1, False),  # a look at the stage, not its real cost
}


def full_model(root: Path, family: str) -> Path:
    """The full-size folder of `family` under `root` (written once, in its own process, then reused)."""
    model_dir = root / f"{family}-full"
    if not (model_dir / "model_index.json").is_file():
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "trt_diffusion", "models", "tiny", "--family", family, "--size", "full",
                        "--out", str(model_dir), "--if-missing"], check=True)
        print(f"  wrote the full-size {family} folder in {time.perf_counter() - started:.0f} s", flush=True)
    return model_dir


def measure_quantize(root: Path, family: str, precision: str, recipe: str) -> dict:
    """One `quantize_component` of the full-size UNet (run in a child: the RSS is its alone)."""
    from tree_memory import GIB, RssSampler, fp32_weight_bytes, marks_from_progress

    calibration, held_out, images = FULL_RECIPES[recipe]
    model_dir = root / f"{family}-full"
    with RssSampler() as sampler, marks_from_progress(sampler):
        sampler.mark("imports")
        from trt_diffusion.engines_file import load_engines_file
        from trt_diffusion.quantize.stage import quantize_component

        path = _config(root, f"full-{family}-{precision}", model_dir, family, precision, "256x256", calibration)
        model = load_engines_file(path).models[f"full-{family}-{precision}"]
        started = time.perf_counter()
        artifact = quantize_component(model, "unet", precision, None, root / "build", held_out_samples=held_out,
                                      compare_images=images, force=True)
        seconds = time.perf_counter() - started
    weights = fp32_weight_bytes(model_dir)
    peak = sampler.peak()
    return {
        "family": family, "precision": precision, "recipe": recipe, "calibration": calibration,
        "held_out": held_out, "images_compared": images, "onnx": str(artifact.onnx_path),
        "quantize_s": round(seconds, 1), "timings_s": artifact.manifest["timings_s"],
        "quantized_layers": len(artifact.manifest["quantized_layers"]),
        "output_psnr_db_min": round(artifact.gate["output_psnr_db_min"], 2),
        "image_psnr_db_min": artifact.gate.get("image_psnr_db_min"),
        "fp32_weights_gib": round(weights / GIB, 2), "peak_rss_gib": round(peak / GIB, 2),
        "peak_over_fp32_weights": round(peak / weights, 2),
        "memory_by_step": {stage: sampler.report(stage) for stage in sampler.stages()},
    }


def measure_latency(root: Path, onnx_path: Path, runs: int) -> dict:
    """ONNX Runtime CPU: the Q/DQ graph against an fp32 graph from the same (legacy) exporter."""
    import torch

    from trt_diffusion.components import Geometry
    from trt_diffusion.engines_file import Size, load_engines_file
    from trt_diffusion.models.loading import load_component
    from trt_diffusion.quantize.feeds import denoiser_interface

    model_dir = root / "sd15-full"
    path = _config(root, "full-latency", model_dir, "sd15", "int8", "256x256", FULL_RECIPES["quick"][0])
    model = load_engines_file(path).models["full-latency"]
    interface = denoiser_interface(model, "unet")
    feeds = interface.definition.dummy_inputs(interface.config, interface.options, Geometry(2, Size(256, 256)))
    result: dict = {}
    fp32_path = root / "fp32" / onnx_path.name
    if not fp32_path.is_file():
        unet = load_component(model_dir, interface.component)
        fp32_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with torch.inference_mode():
            torch.onnx.export(interface.wrapper(unet), tuple(torch.from_numpy(feeds[n]) for n in interface.input_names),
                              str(fp32_path), input_names=interface.input_names,
                              output_names=interface.io.output_names, dynamic_axes=interface.dynamic_axes(),
                              opset_version=_opset(onnx_path), dynamo=False)
        result["fp32_export_s"] = round(time.perf_counter() - started, 1)
        del unet
        gc.collect()
    sessions = {}
    for label, graph in (("fp32", fp32_path), ("int8", onnx_path)):
        started = time.perf_counter()
        sessions[label] = _session(graph)
        result[f"{label}_session_s"] = round(time.perf_counter() - started, 1)
    latencies = _latencies(sessions, feeds, runs)
    result.update({"runs": runs, "fp32_latency_s": round(latencies["fp32"], 3),
                   "int8_latency_s": round(latencies["int8"], 3),
                   "int8_over_fp32": round(latencies["int8"] / latencies["fp32"], 3)})
    return result


def _opset(onnx_path: Path) -> int:
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False)
    return next(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx"))


def bench_full(root: Path, families: list[str], precisions: list[str], recipe: str, runs: int) -> dict:
    results: dict = {}
    for family in families:
        full_model(root, family)
        for precision in precisions:
            print(f"  {family} {precision}, recipe {recipe} (own process; progress on stderr):", flush=True)
            figures = run_step(__file__, ["--step", "quantize", "--workdir", str(root), "--family", family,
                                          "--precision", precision, "--recipe", recipe], live_stderr=True)
            results[f"{family}-{precision}"] = figures
            print(f"  {family} {precision}: {figures['quantize_s']} s {figures['timings_s']}; peak RSS "
                  f"{figures['peak_rss_gib']} GiB = {figures['peak_over_fp32_weights']}x the fp32 weights "
                  f"({figures['fp32_weights_gib']} GiB); output PSNR {figures['output_psnr_db_min']} dB", flush=True)
            for stage, memory in figures["memory_by_step"].items():
                print(f"    {stage:28s} {memory['rss_at_start_gb']:6.2f} -> {memory['rss_peak_gb']:6.2f} GiB "
                      f"(anonymous {memory['anonymous_peak_gb']:.2f})", flush=True)
            if runs and family == "sd15" and precision == "int8":
                latency = run_step(__file__, ["--step", "latency", "--workdir", str(root), "--onnx",
                                              figures["onnx"], "--runs", str(runs)], live_stderr=True)
                figures["latency"] = latency
                print(f"  ORT CPU batch 2, 32x32 latents, median of {runs} interleaved: fp32 "
                      f"{latency['fp32_latency_s']} s, int8 Q/DQ {latency['int8_latency_s']} s, ratio "
                      f"{latency['int8_over_fp32']}", flush=True)
    return results


def cpu_flags() -> list[str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return []
    return sorted(set(re.findall(r"avx512_vnni|avx_vnni|amx_int8", text)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help="also the full-size UNet(s): sd15 needs ~8 GB of RAM, sdxl ~22 GB and 30 GB of disk")
    parser.add_argument("--family", action="append", choices=["sd15", "sdxl"],
                        help="full-size families (repeatable; default sd15)")
    parser.add_argument("--precision", action="append", choices=["int8", "fp8"],
                        help="full-size precisions (repeatable; default int8)")
    parser.add_argument("--recipe", choices=sorted(FULL_RECIPES), default="default",
                        help="full-size calibration and gate: engines.yaml's defaults, or a quick look")
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--runs", type=int, default=0,
                        help="timed ORT runs of the sd15 int8 graph vs fp32, interleaved (median kept; 0: none)")
    parser.add_argument("--workdir", type=Path, help="keep models and artifacts here (reused by a later run)")
    parser.add_argument("--step", choices=["quantize", "latency"], help=argparse.SUPPRESS)  # child processes
    parser.add_argument("--onnx", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)  # live progress lines
        if args.step == "quantize":
            figures = measure_quantize(args.workdir, args.family[0], args.precision[0], args.recipe)
        else:
            figures = measure_latency(args.workdir, args.onnx, args.runs)
        sys.stdout.write(json.dumps(figures) + "\n")
        return 0

    import torch

    report = {"cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(),
              "threads": torch.get_num_threads()}
    print(f"CPU flags: {', '.join(report['cpu_flags']) or 'no VNNI'}; torch threads {report['threads']}")
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
        root = (args.workdir or Path(tmp)).resolve()
        root.mkdir(parents=True, exist_ok=True)
        if not args.skip_tiny:
            print("tiny models (4 prompts x 4 steps calibration, 2 held-out generations):")
            report["tiny"] = bench_tiny(root)
        if args.full:
            print("full-size UNets (random weights):")
            report["full"] = bench_full(root, args.family or ["sd15"], args.precision or ["int8"], args.recipe,
                                        args.runs)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
