"""End-to-end latency per stage: engines (onnxruntime target) vs the PyTorch reference, same requests.

    .venv/bin/python scripts/bench_pipeline.py                 # the tiny default (models/tiny-sd15, 64x64)
    .venv/bin/python scripts/bench_pipeline.py --full          # SD1.5's real UNet (random weights), 256x256

Builds what is missing in a work folder (reused on the next run), then runs the same seeded requests
through both pipelines and reports the medians of text encode, one denoising step and VAE decode, and
their ratios (reference / engine) from this one run.
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
from trt_diffusion.runtime.loader import engine_runners
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--workdir", type=Path, default=Path("build/bench-pipeline"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    work = args.workdir / ("full" if args.full else "tiny")
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "model_index.json").is_file():
        write_tiny_model(model_dir, "sd15", size="full" if args.full else "tiny")
    size = 256 if args.full else 64
    config_path = work / "engines.yaml"
    config_path.write_text(yaml.safe_dump({
        "version": 1, "build": {"workspace": "build"},
        "models": {"m": {"source": "model", "family": "sd15", "buckets": [f"{size}x{size}"], "batch": [1],
                         "targets": ["onnxruntime"],
                         "precision": {"text_encoder": "fp32", "unet": "fp32", "vae_decoder": "fp32"}}}}))
    start = time.perf_counter()
    api.build(config_path)
    print(f"build (export + engines, cached when unchanged): {time.perf_counter() - start:.1f} s")
    config = load_engines_file(config_path)
    _, family, table = engine_runners(config, "m", "onnxruntime")
    pipes = {"engines": EnginePipeline(model_dir, family, table),
             "pytorch": EnginePipeline(model_dir, family, reference_runners(model_dir, family))}
    request = GenerationRequest(prompt="a lighthouse on a cliff", height=size, width=size, steps=args.steps, seed=0)
    results = {}
    for name, pipe in pipes.items():
        pipe.generate(request)  # warm-up: session and allocator first-use costs
        runs = [pipe.generate(request).timings for _ in range(args.runs)]
        results[name] = {
            "text_encode_s": statistics.median(t.text_encode_s for t in runs),
            "step_s": statistics.median(s for t in runs for s in t.step_s),
            "vae_decode_s": statistics.median(t.vae_decode_s for t in runs),
            "total_s": statistics.median(t.total_s for t in runs),
        }
    print(f"{'stage':<14}{'pytorch':>12}{'engines':>12}{'speed-up':>10}")
    for stage in ("text_encode_s", "step_s", "vae_decode_s", "total_s"):
        ref, eng = results["pytorch"][stage], results["engines"][stage]
        print(f"{stage:<14}{ref * 1000:>10.1f}ms{eng * 1000:>10.1f}ms{ref / eng:>9.2f}x")


if __name__ == "__main__":
    main()
