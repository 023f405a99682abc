"""Benchmark the quantize stage.

1. Tiny seeded models (sd15, sdxl, sd3, flux) x (int8, fp8): wall time of `quantize_component` and the gate's
   figures (worst held-out denoiser-output PSNR, worst image PSNR / SSIM against the fp32 pipeline).
2. `--full`: the full-size SD1.5 UNet architecture (860M parameters, random weights): INT8 PTQ with a tiny
   calibration (2 prompts x 1 step at 256x256), then ONNX Runtime CPU latency of the Q/DQ graph against an
   fp32 graph from the same (legacy) exporter, batch 2, 32x32 latents, after a warm-up (`--runs`
   interleaved runs, median; default one).

    python scripts/bench_quantize.py [--full] [--json out.json]

Prints a table and (with --json) writes the numbers. Needs no GPU and no network.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

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
    from trt_diffusion.models.tiny import write_tiny_model
    from trt_diffusion.quantize.stage import quantize_component
    from trt_diffusion.spec import load_engines_file

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


def bench_full(root: Path, runs: int) -> dict:
    import torch

    from trt_diffusion.components import Geometry
    from trt_diffusion.models.loading import load_component
    from trt_diffusion.models.tiny import write_tiny_model
    from trt_diffusion.quantize.feeds import denoiser_interface
    from trt_diffusion.quantize.stage import quantize_component
    from trt_diffusion.spec import Size, load_engines_file

    result: dict = {}
    started = time.perf_counter()
    model_dir = root / "sd15-full"
    if not (model_dir / "model_index.json").is_file():  # a kept --workdir is reused
        write_tiny_model(model_dir, "sd15", size="full")
        result["write_model_s"] = round(time.perf_counter() - started, 1)
        print(f"  wrote the full-size sd15 folder in {result['write_model_s']} s", flush=True)

    path = _config(root, "full", model_dir, "sd15", "int8", "256x256", {"samples": 2, "steps": 1, "seed": 0})
    model = load_engines_file(path).models["full"]
    started = time.perf_counter()
    artifact = quantize_component(model, "unet", "int8", None, root / "build", held_out_samples=1,
                                  compare_images=False)
    result["quantize_s"] = round(time.perf_counter() - started, 1)
    result["quantize_timings_s"] = artifact.manifest["timings_s"]
    result["quantized_layers"] = len(artifact.manifest["quantized_layers"])
    result["output_psnr_db_min"] = round(artifact.gate["output_psnr_db_min"], 2)
    print(f"  int8 PTQ + export + gate: {result['quantize_s']} s ({artifact.manifest['timings_s']}); "
          f"output PSNR {result['output_psnr_db_min']} dB", flush=True)

    gc.collect()  # the stage's pipelines: gigabytes at this size

    # fp32 graph from the same exporter, for a like-for-like latency ratio (ORT reads its per-tensor files)
    interface = denoiser_interface(model, "unet")
    feeds = interface.definition.dummy_inputs(interface.config, interface.options, Geometry(2, Size(256, 256)))
    fp32_path = root / "fp32" / f"model-opset{artifact.manifest['opset']}.onnx"
    if not fp32_path.is_file():
        unet = load_component(model_dir, interface.component)
        fp32_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with torch.inference_mode():
            torch.onnx.export(interface.wrapper(unet), tuple(torch.from_numpy(feeds[n]) for n in interface.input_names),
                              str(fp32_path), input_names=interface.input_names,
                              output_names=interface.io.output_names, dynamic_axes=interface.dynamic_axes(),
                              opset_version=artifact.manifest["opset"], dynamo=False)
        result["fp32_export_s"] = round(time.perf_counter() - started, 1)
        del unet
        gc.collect()

    sessions = {}
    for label, onnx_path in (("fp32", fp32_path), ("int8", artifact.onnx_path)):
        started = time.perf_counter()
        sessions[label] = _session(onnx_path)
        result[f"{label}_session_s"] = round(time.perf_counter() - started, 1)
    latencies = _latencies(sessions, feeds, runs)
    del sessions
    result["fp32_latency_s"] = round(latencies["fp32"], 3)
    result["int8_latency_s"] = round(latencies["int8"], 3)
    result["int8_over_fp32"] = round(latencies["int8"] / latencies["fp32"], 3)
    print(f"  ORT CPU batch 2, 32x32 latents, median of {runs} interleaved: fp32 {result['fp32_latency_s']} s, "
          f"int8 Q/DQ {result['int8_latency_s']} s, ratio int8/fp32 {result['int8_over_fp32']}", flush=True)
    return result


def cpu_flags() -> list[str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return []
    return sorted(set(re.findall(r"avx512_vnni|avx_vnni|amx_int8", text)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help="also the full-size SD1.5 UNet (about 5 minutes, 20 GB RAM)")
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--runs", type=int, default=1,
                        help="timed ORT runs per graph, interleaved (the median is kept)")
    parser.add_argument("--workdir", type=Path, help="keep models and artifacts here (reused by a later run)")
    args = parser.parse_args()

    import torch

    report = {"cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(),
              "threads": torch.get_num_threads()}
    print(f"CPU flags: {', '.join(report['cpu_flags']) or 'no VNNI'}; torch threads {report['threads']}")
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
        root = args.workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        if not args.skip_tiny:
            print("tiny models (4 prompts x 4 steps calibration, 2 held-out generations):")
            report["tiny"] = bench_tiny(root)
        if args.full:
            print("full-size SD1.5 UNet (random weights):")
            report["full_sd15"] = bench_full(root, args.runs)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
