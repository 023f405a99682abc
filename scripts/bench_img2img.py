"""What an img2img request costs against a txt2img one on the same engines, and the VAE encoder's share.

    .venv/bin/python scripts/bench_img2img.py            # SD1.5's real UNet and VAE (random weights), 256x256, CPU
    .venv/bin/python scripts/bench_img2img.py --tiny     # the tiny model, 64x64 (a smoke run)

One build (onnxruntime, fp32, `workflows: [txt2img, img2img]`). In one run, interleaved, the median wall time of
a whole request (text encoders, denoising, VAE) for txt2img and for img2img at `--strength` (default 0.5: half
the schedule's steps), with the VAE encoder's own time inside the img2img request.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import yaml

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.models.tiny import write_tiny_model
from trt_diffusion.runtime.engines import RunnerTable
from trt_diffusion.runtime.loader import engine_runners
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.sample_inputs import init_image


class _Timed:
    """A runner that adds its wall time to `spent` (the VAE encoder's share)."""

    def __init__(self, runner, spent: list[float]):
        self._runner, self._spent, self.inputs = runner, spent, runner.inputs

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def run(self, feeds):
        start = time.perf_counter()
        try:
            return self._runner.run(feeds)
        finally:
            self._spent.append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--workdir", type=Path, default=Path("build/bench-img2img"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--strength", type=float, default=0.5)
    args = parser.parse_args()
    work = args.workdir / ("tiny" if args.tiny else "full")
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "model_index.json").is_file():
        write_tiny_model(model_dir, "sd15", size="tiny" if args.tiny else "full")
    size = 64 if args.tiny else 256
    config_path = work / "engines.yaml"
    config_path.write_text(yaml.safe_dump({
        "version": 1, "build": {"workspace": "build"},
        "models": {"m": {"source": "model", "family": "sd15", "buckets": [f"{size}x{size}"], "batch": [1],
                         "targets": ["onnxruntime"], "workflows": ["txt2img", "img2img"],
                         "precision": {"text_encoder": "fp32", "unet": "fp32", "vae_decoder": "fp32"}}}}))
    start = time.perf_counter()
    api.build(config_path)
    print(f"build (cached when unchanged): {time.perf_counter() - start:.1f} s")
    _, family, table = engine_runners(load_engines_file(config_path), "m", "onnxruntime")
    encoder_s: list[float] = []
    timed = RunnerTable()
    for entry in table.entries:
        runner = _Timed(entry.runner, encoder_s) if entry.component == "vae_encoder" else entry.runner
        timed.add(entry.component, runner, bucket=entry.bucket, batch=entry.batch, controlnet=entry.controlnet)
    pipe = EnginePipeline(model_dir, family, timed, ("txt2img", "img2img"))
    txt = GenerationRequest(prompt="a lighthouse", height=size, width=size, steps=args.steps, seed=0)
    img = GenerationRequest(prompt="a lighthouse", height=size, width=size, steps=args.steps, seed=0,
                            workflow="img2img", init_image=init_image(size, size, 0), strength=args.strength)
    pipe.generate(txt), pipe.generate(img)  # warm-up: first-call allocations
    walls = {"txt2img": [], "img2img": []}
    encoder = []
    denoiser_steps = {}
    for _ in range(args.runs):
        for name, request in (("txt2img", txt), ("img2img", img)):
            encoder_s.clear()
            start = time.perf_counter()
            result = pipe.generate(request)
            walls[name].append(time.perf_counter() - start)
            denoiser_steps[name] = len(result.timings.step_s)
            if name == "img2img":
                encoder.append(sum(encoder_s))
    t, i, e = (statistics.median(v) for v in (walls["txt2img"], walls["img2img"], encoder))
    print(f"sd15 {'tiny' if args.tiny else 'full-size'} {size}x{size}, onnxruntime fp32, {args.steps} steps, CFG "
          f"batched, median of {args.runs} interleaved runs")
    print(f"txt2img: {t:.3f} s ({denoiser_steps['txt2img']} denoiser steps)")
    print(f"img2img strength {args.strength}: {i:.3f} s ({denoiser_steps['img2img']} denoiser steps) = "
          f"{i / t:.2f}x txt2img")
    print(f"VAE encoder inside img2img: {e:.3f} s = {100 * e / i:.1f}% of the img2img request")


if __name__ == "__main__":
    main()
