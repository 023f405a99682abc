"""LoRA refit on fp8/int8 UNets (no recalibration) against the fused-and-recalibrated variant of the same LoRA.

    .venv/bin/python scripts/bench_quantized_refit.py                       # int8 and fp8, calibration `max`
    .venv/bin/python scripts/bench_quantized_refit.py --precision int8 --algorithm smoothquant

For each precision, two engines.yaml over the tiny seeded SD1.5 model (its LoRA at scale 1) sharing one
workspace: `mode: refit` (the base UNet quantized once, the LoRA refitted into its onnxruntime engine: weights
and recomputed weight scales, calibrated activation scales kept) and `mode: fused` (the LoRA fused, calibrated
and gated again: the reference). Images of both, same prompts and seeds, compared by PSNR/SSIM; the base
quantized engine's images too (how far the LoRA moves them). Times: the refit (LoRA weights + session) against
the fused rebuild (calibration + Q/DQ export + gate + engine build of the variant). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["a lighthouse on a cliff at dusk", "a red bicycle leaning on a brick wall"]
SEEDS = [7, 8]
ARGS = dict(height=64, width=64, steps=4, guidance_scale=5.0)


def write_config(path: Path, model_dir: Path, workspace: Path, precision: str, algorithm: str, mode: str) -> Path:
    model = {"source": str(model_dir), "family": "sd15", "components": ["text_encoder", "unet", "vae_decoder"],
             "precision": {"text_encoder": "fp32", "unet": precision, "vae_decoder": "fp32"},
             "buckets": ["64x64"], "batch": [1], "targets": ["onnxruntime"],
             "quantization": {"calibration": {"samples": 2, "steps": 2, "seed": 0, "algorithm": algorithm}},
             "loras": {"style": {"source": str(model_dir / "lora/pytorch_lora_weights.safetensors"), "mode": mode,
                                 "scale": 1.0}}}
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": str(workspace)}, "models": {"m": model}}))
    return path


def images(config, **kw):
    from trt_diffusion.runtime.loader import engine_runners
    from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest

    model_dir, family, table = engine_runners(config, "m", "onnxruntime", **kw)
    pipe = EnginePipeline(model_dir, family, table)
    return [pipe.generate(GenerationRequest(prompt=p, seed=s, **ARGS)).images for p in PROMPTS for s in SEEDS]


def compare(reference, candidate) -> dict:
    from trt_diffusion.metrics import psnr, ssim

    values = [(psnr(r, c), ssim(r[0], c[0])) for r, c in zip(reference, candidate)]
    worst = min(v[0] for v in values)
    return {"worst_psnr_db": None if math.isinf(worst) else round(worst, 2),
            "worst_ssim": round(min(v[1] for v in values), 4)}


def run(precision: str, algorithm: str, root: Path) -> dict:
    from trt_diffusion import api
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.models.tiny import write_tiny_model

    model_dir = root / "sd15"
    if not (model_dir / "model_index.json").exists():
        write_tiny_model(model_dir, "sd15", lora=True)
    workspace = root / "build"
    refit_cfg = write_config(root / f"refit-{precision}-{algorithm}.yaml", model_dir, workspace, precision, algorithm,
                             "refit")
    fused_cfg = write_config(root / f"fused-{precision}-{algorithm}.yaml", model_dir, workspace, precision, algorithm,
                             "fused")
    start = time.perf_counter()
    report = api.build(refit_cfg, target="onnxruntime")
    base_build_s = time.perf_counter() - start
    assert not report.failed, [o.failure for o in report.failed]
    refit_config = load_engines_file(refit_cfg)
    lora = refit_config.models["m"].loras["style"].path

    base_images = images(refit_config)
    start = time.perf_counter()
    from trt_diffusion.runtime.loader import engine_runners

    engine_runners(refit_config, "m", "onnxruntime", loras=[(lora, 1.0)])  # LoRA weights + refitted sessions
    refit_s = time.perf_counter() - start
    refit_images = images(refit_config, loras=[(lora, 1.0)])

    start = time.perf_counter()
    report = api.build(fused_cfg, target="onnxruntime", component="unet")  # base artifact cached: the variant
    fused_rebuild_s = time.perf_counter() - start
    assert not report.failed, [o.failure for o in report.failed]
    fused_config = load_engines_file(fused_cfg)
    api.build(fused_cfg, target="onnxruntime")
    fused_images = images(fused_config, lora_variant="style")
    return {"precision": precision, "algorithm": algorithm,
            "refit_vs_fused_recalibrated": compare(fused_images, refit_images),
            "base_vs_fused_recalibrated": compare(fused_images, base_images),
            "refit_vs_base": compare(base_images, refit_images),
            "refit_s": round(refit_s, 2), "fused_rebuild_s": round(fused_rebuild_s, 2),
            "first_build_s": round(base_build_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", action="append", choices=["int8", "fp8"])
    parser.add_argument("--algorithm", default="max", choices=["max", "smoothquant", "percentile"])
    parser.add_argument("--root", type=Path, default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="bench-qrefit-"))
    root.mkdir(parents=True, exist_ok=True)
    results = [run(p, args.algorithm, root) for p in (args.precision or ["int8", "fp8"])]
    print(json.dumps({"root": str(root), "results": results}, indent=1))


if __name__ == "__main__":
    main()
