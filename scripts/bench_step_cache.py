"""Step caching (DeepCache) on the whole pipeline: speed and quality against the uncached engine, per target.

    .venv/bin/python scripts/bench_step_cache.py                       # SD1.5's real UNet (random weights), 512², 20 steps
    .venv/bin/python scripts/bench_step_cache.py --targets openvino --repeats 3 --intervals 2,3,5

Builds the model's engines with `step_cache: {method: deepcache, branch: B}` in a work folder (reused on the next
run), then runs the same seeded request (batch 1, CFG batched: the UNet at batch 2) through one pipeline per
interval, interleaved (uncached, N=2, N=3, ... then again), after one short warm-up each, and reports the median
whole-pipeline time, the speed-up over the uncached run and the PSNR/SSIM of each cached image against the uncached
image of the same target. The uncached run is STEP_CACHE=off: the uncached UNet engine every step.

Memory: the full UNet's three engines per target (unet, unet_deep, unet_shallow) are loaded together (~3.4 GB of
weights each plus working memory): one target at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import yaml

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.metrics import psnr, ssim
from trt_diffusion.models.tiny import write_tiny_model
from trt_diffusion.runtime.loader import engine_runners
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="the tiny model at 64² (a smoke run of the script)")
    parser.add_argument("--workdir", type=Path, default=Path("build/bench-step-cache"))
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--intervals", default="2,3,5")
    parser.add_argument("--branch", type=int, default=0)
    parser.add_argument("--targets", default="onnxruntime,openvino")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    work = args.workdir / ("tiny" if args.tiny else "full")
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "model_index.json").is_file():
        write_tiny_model(model_dir, "sd15", size="tiny" if args.tiny else "full")
    size = 64 if args.tiny else args.size
    targets = args.targets.split(",")
    config_path = work / "engines.yaml"
    config_path.write_text(yaml.safe_dump({
        "version": 1, "build": {"workspace": "build"},
        "models": {"m": {"source": "model", "family": "sd15", "buckets": [f"{size}x{size}"], "batch": [1],
                         "targets": targets, "components": ["text_encoder", "unet", "vae_decoder"],
                         "precision": {"text_encoder": "fp32", "unet": "fp32", "vae_decoder": "fp32"},
                         "step_cache": {"method": "deepcache", "branch": args.branch}}}}))
    start = time.perf_counter()
    report = api.build(config_path)
    if report.failed:
        raise SystemExit(f"build failed: {[o.error for o in report.failed]}")
    print(f"build (export + engines, cached when unchanged): {time.perf_counter() - start:.1f} s", flush=True)
    config = load_engines_file(config_path)
    cache = config.models["m"].step_cache
    intervals = [int(i) for i in args.intervals.split(",")]
    request = GenerationRequest(prompt="a lighthouse on a cliff at dusk", height=size, width=size, steps=args.steps,
                                guidance_scale=7.5, seed=0)
    figures = {"size": size, "steps": args.steps, "branch": args.branch, "repeats": args.repeats, "targets": {}}
    for target in targets:
        model_dir_, family, table = engine_runners(config, "m", target)
        runs = {"uncached": (EnginePipeline(model_dir_, family, table, step_cache=cache), "off")}
        for interval in intervals:
            runs[f"N={interval}"] = (EnginePipeline(model_dir_, family, table,
                                                    step_cache=replace(cache, interval=interval)), "on")
        for pipe, mode in runs.values():  # sessions' first-use costs, on a short request
            pipe.generate(replace(request, steps=2, step_cache=mode))
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        images = {}
        for repeat in range(args.repeats):
            for name, (pipe, mode) in runs.items():  # interleaved: a drift of the machine touches every run alike
                started = time.perf_counter()
                generation = pipe.generate(replace(request, step_cache=mode))
                seconds[name].append(time.perf_counter() - started)
                images[name] = generation.images[0]
                print(f"{target} {name} run {repeat + 1}: {seconds[name][-1]:.1f} s "
                      f"{generation.timings.step_schedule or 'uncached'}", flush=True)
        base = statistics.median(seconds["uncached"])
        rows = {}
        for name in runs:
            median = statistics.median(seconds[name])
            rows[name] = {"median_s": median, "runs_s": seconds[name], "speedup": base / median,
                          "psnr_db": psnr(images["uncached"], images[name]),
                          "ssim": ssim(images["uncached"], images[name])}
        figures["targets"][target] = rows
        print(f"\n{target}: {size}², {args.steps} steps, median of {args.repeats}")
        print(f"{'run':<10}{'median':>10}{'speed-up':>10}{'PSNR':>10}{'SSIM':>8}")
        for name, row in rows.items():
            shown = "inf" if row["psnr_db"] == float("inf") else f"{row['psnr_db']:.1f}"
            print(f"{name:<10}{row['median_s']:>9.1f}s{row['speedup']:>9.2f}x{shown:>8} dB{row['ssim']:>8.3f}",
                  flush=True)
        del runs, table  # one target's sessions at a time
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
