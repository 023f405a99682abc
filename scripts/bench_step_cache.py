"""Step caching on the whole pipeline: speed and quality against the uncached engine, per target.

    .venv/bin/python scripts/bench_step_cache.py                       # SD1.5's real UNet (random weights), 512², 20 steps
    .venv/bin/python scripts/bench_step_cache.py --targets openvino --repeats 3 --intervals 2,3,5
    .venv/bin/python scripts/bench_step_cache.py --family flux --targets onnxruntime   # first-block, mid-size FLUX

`--family flux` measures first-block caching on a mid-size FLUX.1: the tiny seeded FLUX folder with its transformer
widened to 16 heads × 64 (1024 wide), 4 double-stream and 8 single-stream blocks (about 0.3B parameters, 1.1 GB
fp32), at 256² (256 image tokens), one run per `--thresholds` value.

Builds the model's engines with `step_cache: {method: deepcache, branch: B}` (or `first_block`) in a work folder (reused on the next
run), then runs the same seeded request (batch 1, CFG batched: the UNet at batch 2) through one pipeline per
interval or threshold, interleaved (uncached, N=2, N=3, ... then again), after one short warm-up each, and reports the median
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


def write_mid_flux(model_dir: Path) -> None:
    """The tiny seeded FLUX folder with a mid-size transformer (seeded, every weight offset like the tiny ones')."""
    import diffusers
    import torch

    from trt_diffusion.models.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("flux")
    torch.manual_seed(1)
    tiny = pipe.transformer.config
    pipe.transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=tiny.in_channels, num_layers=4, num_single_layers=8, attention_head_dim=64,
        num_attention_heads=16, joint_attention_dim=tiny.joint_attention_dim,
        pooled_projection_dim=tiny.pooled_projection_dim, axes_dims_rope=(8, 28, 28), guidance_embeds=True).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, param in sorted(pipe.transformer.named_parameters()):
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    partial = model_dir.with_name(model_dir.name + ".partial")  # renamed when whole: a stopped run leaves no half model
    pipe.save_pretrained(partial, safe_serialization=True)
    partial.rename(model_dir)


def model_entry(family: str, size: int, targets: list[str], branch: int) -> dict:
    """The engines.yaml entry of the measured model: fp32 engines, the family's step cache."""
    if family == "flux":
        components = ["text_encoder", "text_encoder_2", "transformer", "vae_decoder"]
        return {"source": "model", "family": "flux", "buckets": [f"{size}x{size}"], "batch": [1], "cfg": ["none"],
                "targets": targets, "components": components, "precision": dict.fromkeys(components, "fp32"),
                "step_cache": {"method": "first_block"}}
    components = ["text_encoder", "unet", "vae_decoder"]
    return {"source": "model", "family": "sd15", "buckets": [f"{size}x{size}"], "batch": [1], "targets": targets,
            "components": components, "precision": dict.fromkeys(components, "fp32"),
            "step_cache": {"method": "deepcache", "branch": branch}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="the tiny model at 64² (a smoke run of the script)")
    parser.add_argument("--family", choices=["sd15", "flux"], default="sd15",
                        help="sd15: DeepCache on the full-size UNet; flux: first-block caching on a mid-size FLUX")
    parser.add_argument("--workdir", type=Path, default=Path("build/bench-step-cache"))
    parser.add_argument("--size", type=int, default=None, help="pixels per side (default 512 sd15, 256 flux)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--intervals", default="2,3,5", help="DeepCache intervals (sd15)")
    parser.add_argument("--thresholds", default="0.08,0.5,0.55,0.6,0.7", help="first-block thresholds (flux): the default 0.08, and those that skip steps on random weights")
    parser.add_argument("--branch", type=int, default=0)
    parser.add_argument("--targets", default="onnxruntime,openvino")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    flux = args.family == "flux"
    work = args.workdir / (f"{args.family}-tiny" if args.tiny else "flux-mid" if flux else "full")
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "model_index.json").is_file():
        if flux and not args.tiny:
            write_mid_flux(model_dir)
        else:
            write_tiny_model(model_dir, args.family, size="tiny" if args.tiny else "full")
    size = 64 if args.tiny else args.size or (256 if flux else 512)
    targets = args.targets.split(",")
    config_path = work / "engines.yaml"
    config_path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build"},
                                           "models": {"m": model_entry(args.family, size, targets, args.branch)}}))
    start = time.perf_counter()
    report = api.build(config_path)
    if report.failed:
        raise SystemExit(f"build failed: {[o.error for o in report.failed]}")
    print(f"build (export + engines, cached when unchanged): {time.perf_counter() - start:.1f} s", flush=True)
    config = load_engines_file(config_path)
    cache = config.models["m"].step_cache
    if flux:  # the cached variants: one per threshold
        variants = {f"t={t}": replace(cache, threshold=float(t)) for t in args.thresholds.split(",")}
    else:  # one per interval
        variants = {f"N={n}": replace(cache, interval=int(n)) for n in args.intervals.split(",")}
    request = GenerationRequest(prompt="a lighthouse on a cliff at dusk", height=size, width=size, steps=args.steps,
                                guidance_scale=3.5 if flux else 7.5, seed=0)
    figures = {"family": args.family, "size": size, "steps": args.steps, "branch": args.branch,
               "repeats": args.repeats, "targets": {}}
    for target in targets:
        model_dir_, family, table = engine_runners(config, "m", target)
        runs = {"uncached": (EnginePipeline(model_dir_, family, table, step_cache=cache), "off")}
        for name, variant in variants.items():
            runs[name] = (EnginePipeline(model_dir_, family, table, step_cache=variant), "on")
        for pipe, mode in runs.values():  # sessions' first-use costs, on a short request
            pipe.generate(replace(request, steps=2, step_cache=mode))
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        images, schedules = {}, {}
        for repeat in range(args.repeats):
            for name, (pipe, mode) in runs.items():  # interleaved: a drift of the machine touches every run alike
                started = time.perf_counter()
                generation = pipe.generate(replace(request, step_cache=mode))
                seconds[name].append(time.perf_counter() - started)
                images[name] = generation.images[0]
                schedules[name] = generation.timings.step_schedule or "uncached"
                print(f"{target} {name} run {repeat + 1}: {seconds[name][-1]:.1f} s "
                      f"{generation.timings.step_schedule or 'uncached'}", flush=True)
        base = statistics.median(seconds["uncached"])
        rows = {}
        for name in runs:
            median = statistics.median(seconds[name])
            rows[name] = {"median_s": median, "runs_s": seconds[name], "speedup": base / median,
                          "psnr_db": psnr(images["uncached"], images[name]),
                          "ssim": ssim(images["uncached"], images[name]), "schedule": schedules[name]}
        figures["targets"][target] = rows
        print(f"\n{target}: {size}², {args.steps} steps, median of {args.repeats}")
        print(f"{'run':<10}{'median':>10}{'speed-up':>10}{'PSNR':>10}{'SSIM':>8}  schedule")
        for name, row in rows.items():
            shown = "inf" if row["psnr_db"] == float("inf") else f"{row['psnr_db']:.1f}"
            print(f"{name:<10}{row['median_s']:>9.1f}s{row['speedup']:>9.2f}x{shown:>8} dB{row['ssim']:>8.3f}"
                  f"  {row['schedule']}", flush=True)
        del runs, table  # one target's sessions at a time
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
