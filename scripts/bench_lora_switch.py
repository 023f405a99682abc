"""LoRA per request: what switching an engine between LoRA sets costs (issue 28), on the path a served engine model
takes (targets/lora_switch.py over the files `package` writes, the target's `lora_runner`).

    .venv/bin/python scripts/bench_lora_switch.py --size tiny --workdir /tmp/lora-bench
    .venv/bin/python scripts/bench_lora_switch.py --size full --workdir /tmp/lora-bench   # SD1.5 UNet, 860M

Builds the model's UNet engine (256x256, batch 1 with CFG batched: UNet batch 2) on each target with two refit LoRAs
(rank 4 on every attention projection, 128 weights), writes their parts as `package` does, and times per target:
the first use of a set (fused weights + the refitted runner), the second set, a set kept in the LRU (a lookup), the
return to base, each run after it, and the process RSS each kept set adds. A -> B -> A and base are checked bit for
bit. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trt_diffusion import api  # noqa: E402
from trt_diffusion.targets import get_target  # noqa: E402
from trt_diffusion.targets.lora_switch import FOLDER, LoraParts, LoraSwitchingRunner  # noqa: E402

SIZE = 256


def _rss_gb() -> float:
    return psutil.Process().memory_info().rss / 1e9


def _uss_gb() -> float:
    """Memory only this process holds: RSS counts every mapping of a file's pages (OpenVINO maps the IR's weights
    once per compiled model), USS counts what would be freed."""
    return psutil.Process().memory_full_info().uss / 1e9


def _model(workdir: Path, size: str) -> tuple[Path, Path]:
    """The model folder with its LoRA (`style`) and a second LoRA (`detail`: the same layers, other values)."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = workdir / f"sd15-{size}"
    if not (folder / "model_index.json").is_file():
        api.make_tiny_model(folder, "sd15", size=size, lora=True, overwrite=folder.exists())
    style = folder / "lora" / "pytorch_lora_weights.safetensors"
    detail = workdir / "detail.safetensors"
    if not detail.is_file():
        generator = torch.Generator().manual_seed(28)
        save_file({k: torch.randn(v.shape, generator=generator) * v.float().std()
                   for k, v in sorted(load_file(str(style)).items())}, str(detail))
    return style, detail


def _config(workdir: Path, size: str, targets: list[str]) -> Path:
    style, detail = _model(workdir, size)
    document = {"version": 1, "build": {"workspace": str(workdir / "build")}, "models": {"sd15": {
        "source": str(workdir / f"sd15-{size}"), "family": "sd15", "components": ["unet"],
        "buckets": [f"{SIZE}x{SIZE}"], "batch": [1], "cfg": ["batched"], "targets": targets,
        "precision": {"unet": "fp32"},
        "loras": {"style": {"source": str(style), "mode": "refit"},
                  "detail": {"source": str(detail), "mode": "refit"}}}}}
    path = workdir / "engines.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def _forget_torch_modules() -> None:
    from trt_diffusion.engine_builds import stage

    with stage._module_lock:
        stage._modules.clear()
    gc.collect()


def _version_folder(engine, parts, out: Path) -> Path:
    """What `package` writes for the engine model: the engine's files (hard links) and `loras/`."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for item in Path(engine.path).iterdir():
        if item.is_file():
            os.link(item, out / item.name)
    shutil.copytree(parts["unet"].folder, out / FOLDER, copy_function=os.link)
    return out


def _feeds(runner) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal([d if isinstance(d, int) else 1 for d in spec.shape]).astype(spec.dtype)
            for name, spec in runner.inputs.items()}


def _run(runner, feeds) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    (value,) = runner.run(feeds).values()
    return value, time.perf_counter() - start


def bench_target(config_path: Path, target: str, workdir: Path, capacity: int) -> dict:
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import built_engines
    from trt_diffusion.triton.lora_parts import write_parts

    config = load_engines_file(config_path, check_sources=True)
    engines = built_engines(config, "sd15", target)
    (unet,) = [e for e in engines if e.spec.component == "unet"]
    start = time.perf_counter()
    parts = write_parts(config, "sd15", engines, workdir / f"parts-{target}")
    parts_s = time.perf_counter() - start
    _forget_torch_modules()  # the UNet's torch weights (GBs at full size) are not part of what a server holds
    folder = _version_folder(unet, parts, workdir / f"version-{target}")
    gc.collect()
    chosen = get_target(target)
    rss, uss = {"start": _rss_gb()}, {"start": _uss_gb()}
    start = time.perf_counter()
    base = chosen.runner_from_files(folder, unet.spec.name)
    base_load_s = time.perf_counter() - start
    runner = LoraSwitchingRunner(base, LoraParts.read(folder),
                                 lambda weights: chosen.lora_runner(folder, unet.spec.name, weights, base=base),
                                 capacity=capacity)
    feeds = _feeds(runner)
    base_out, _ = _run(runner, feeds)  # warm-up
    base_runs = [_run(runner, feeds)[1] for _ in range(3)]
    rss["base"], uss["base"] = _rss_gb(), _uss_gb()
    result = {"target": target, "parts_write_s": round(parts_s, 2), "base_load_s": round(base_load_s, 2),
              "base_run_s": round(statistics.median(base_runs), 3)}
    style, detail = [("style", 1.0)], [("detail", 0.8)]
    first = runner.select(style)
    style_out, first_run = _run(runner, feeds)
    rss["one_set"], uss["one_set"] = _rss_gb(), _uss_gb()
    second = runner.select(detail)
    _, second_run = _run(runner, feeds)
    rss["two_sets"], uss["two_sets"] = _rss_gb(), _uss_gb()
    hits = []
    for _ in range(5):
        hits.append(runner.select(style))
        runner.select(detail)
    runner.select(style)
    style_again, hit_run = _run(runner, feeds)
    to_base = runner.select([])
    after_base, _ = _run(runner, feeds)
    result.update({
        "first_use_s": round(first, 2), "first_run_after_s": round(first_run, 3),
        "second_set_s": round(second, 2), "second_run_after_s": round(second_run, 3),
        "lru_hit_ms": round(1000 * statistics.median(hits), 4), "run_after_hit_s": round(hit_run, 3),
        "to_base_ms": round(1000 * to_base, 4),
        "rss_gb": {k: round(v, 2) for k, v in rss.items()},
        "rss_per_cached_set_gb": round((rss["two_sets"] - rss["base"]) / 2, 2),
        "uss_gb": {k: round(v, 2) for k, v in uss.items()},
        "uss_per_cached_set_gb": round((uss["two_sets"] - uss["base"]) / 2, 2),
        "a_b_a_bit_exact": bool(np.array_equal(style_again, style_out)),
        "base_after_bit_exact": bool(np.array_equal(after_base, base_out)),
        "lora_effect_max_abs": float(np.abs(style_out - base_out).max()),
        "refits": runner.switches,
    })
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--targets", default="onnxruntime,openvino")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--capacity", type=int, default=4)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    targets = [t for t in args.targets.split(",") if t]
    config = _config(args.workdir, args.size, targets)
    start = time.perf_counter()
    report = api.build(config)
    if report.failed:
        raise SystemExit(f"build failed: {[o.error for o in report.failed]}")
    _forget_torch_modules()
    results = {"size": args.size, "latents": f"2x4x{SIZE // 8}x{SIZE // 8}",
               "build_s": round(time.perf_counter() - start, 1), "targets": []}
    for target in targets:
        print(f"benchmarking {target} ...", file=sys.stderr, flush=True)
        results["targets"].append(bench_target(config, target, args.workdir, args.capacity))
        gc.collect()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
