"""What a no-CFG request (guidance <= 1: distilled models) costs on the engines there are.

    .venv/bin/python scripts/bench_no_cfg.py            # SD1.5's real UNet (random weights), 256x256, CPU
    .venv/bin/python scripts/bench_no_cfg.py --tiny     # the tiny model, 64x64 (a smoke run)

One build with `cfg: [batched, split]` gives UNet engines at batch 2 (what `cfg: batched` alone builds) and
batch 1. In one run, interleaved, the median denoising step of: CFG on the batch-2 engine; no CFG on the batch-2
engine (the batch-1 rows padded to 2: what a `cfg: batched` build serves); no CFG on the batch-1 engine; and the
PyTorch reference without CFG.
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
from trt_diffusion.runtime.reference import reference_runners


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--workdir", type=Path, default=Path("build/bench-no-cfg"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
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
                         "cfg": ["batched", "split"], "targets": ["onnxruntime"],
                         "precision": {"text_encoder": "fp32", "unet": "fp32", "vae_decoder": "fp32"}}}}))
    start = time.perf_counter()
    api.build(config_path)
    print(f"build (cached when unchanged): {time.perf_counter() - start:.1f} s")
    _, family, table = engine_runners(load_engines_file(config_path), "m", "onnxruntime")
    batch2_only = RunnerTable([e for e in table.entries if not (e.component == "unet" and e.batch == 1)])
    engines_b2 = EnginePipeline(model_dir, family, batch2_only)
    engines_b1 = EnginePipeline(model_dir, family, table)  # exact batch-1 UNet for no-CFG
    pytorch = EnginePipeline(model_dir, family, reference_runners(model_dir, family))

    def request(guidance: float) -> GenerationRequest:
        return GenerationRequest(prompt="a lighthouse", height=size, width=size, steps=args.steps, seed=0,
                                 guidance_scale=guidance)

    cases = {"CFG, batch-2 engine": (engines_b2, 7.5), "no CFG, batch-2 engine (padded)": (engines_b2, 1.0),
             "no CFG, batch-1 engine": (engines_b1, 1.0), "no CFG, PyTorch fp32 eager": (pytorch, 1.0)}
    steps: dict[str, list[float]] = {name: [] for name in cases}
    for pipe, guidance in cases.values():
        pipe.generate(request(guidance))  # warm-up
    for _ in range(args.runs):  # interleaved: each round runs every case once
        for name, (pipe, guidance) in cases.items():
            steps[name] += pipe.generate(request(guidance)).timings.step_s
    base = statistics.median(steps["CFG, batch-2 engine"])
    print(f"{'case':<36}{'step (median)':>16}{'vs CFG':>10}")
    for name, values in steps.items():
        median = statistics.median(values)
        print(f"{name:<36}{median * 1000:>13.1f} ms{base / median:>9.2f}x")


if __name__ == "__main__":
    main()
