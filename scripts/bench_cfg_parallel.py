"""`cfg: split` vs `cfg: parallel` vs `cfg: batched` on a Wan transformer, in process, on this CPU.

    .venv/bin/python scripts/bench_cfg_parallel.py                 # mid-size transformer, 128x128x9, onnxruntime
    .venv/bin/python scripts/bench_cfg_parallel.py --size tiny     # the tests' tiny model, 32x32x5 (a smoke run)

The tiny Wan transformer (2 layers of width 24) costs under 1 ms a call, a few percent of a step (the UniPC step
and the host work around it cost far more), so it can show nothing about the calls. `--size mid` (default) replaces
it in the tiny folder with a seeded WanTransformer3DModel of width 256 (4 heads of 64), 6 layers, FFN 1024 (7.0M
parameters; the text encoder and VAE stay tiny), run at 128x128x9: 3 latent frames of 16x16, 192 tokens.

One build with `cfg: [batched, parallel]` gives the transformer at batch 1 (split's and parallel's engine) and
batch 2 (batched's). Pipelines over the same engines: split (one session, the two calls one after the other),
parallel (two sessions, the calls at once: runtime/cfg_parallel.py), parallel with each session held to cores/2
intra-op threads (the cores shared out instead of both sessions spreading over all of them) and split at that
thread count (the control: what the thread count alone changes), and batched (one batch-2 call). Interleaved
rounds: each round runs every case once; the medians of `--runs` rounds (>= 5) of the denoising time per request
and their ratio to split. Every video is checked equal to split's (batched: its PSNR against split's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import yaml

from trt_diffusion.workspace.provenance import cpu_name

MID_TRANSFORMER = dict(num_attention_heads=4, attention_head_dim=64, ffn_dim=1024, num_layers=6, rope_max_seq_len=1024)
BUCKETS = {"tiny": "32x32x5", "mid": "128x128x9"}


def model_folder(work: Path, size: str) -> Path:
    """The tiny Wan 2.1 folder, its transformer swapped for the mid-size one (seeded) when asked."""
    import torch
    from diffusers import WanTransformer3DModel

    from trt_diffusion.models.tiny import write_tiny_model
    from trt_diffusion.models.tiny_video import TINY_TRANSFORMER

    folder = work / f"wan-{size}"
    if (folder / "model_index.json").is_file():
        return folder
    write_tiny_model(folder, "wan")
    if size == "mid":
        torch.manual_seed(0)
        transformer = WanTransformer3DModel(**{**TINY_TRANSFORMER, **MID_TRANSFORMER})
        with torch.no_grad():  # diffusers zero-initialises some projections: give every weight a value
            for parameter in transformer.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.02)
        for old in (folder / "transformer").glob("*.safetensors"):
            old.unlink()
        transformer.save_pretrained(folder / "transformer", safe_serialization=True)
    return folder


def engines(work: Path, folder: Path, bucket: str, target: str) -> Path:
    path = work / f"engines-{folder.name}.yaml"
    path.write_text(yaml.safe_dump({
        "version": 1, "build": {"workspace": str(work / "build")},
        "models": {"wan": {"source": str(folder), "family": "wan", "buckets": [bucket], "batch": [1],
                           "cfg": ["batched", "parallel"], "targets": [target],
                           "precision": {"text_encoder": "fp32", "transformer": "fp32", "vae_decoder": "fp32"}}}},
        sort_keys=False))
    return path


def threads_held(table, threads: int, target: str):
    """The same table with every transformer runner rebuilt at `threads` intra-op threads (onnxruntime only)."""
    import onnxruntime as ort

    from trt_diffusion.runtime.engines import RunnerTable
    from trt_diffusion.targets.onnxruntime.runner import OnnxRuntimeRunner, session_options

    if target != "onnxruntime":
        return None
    held = RunnerTable()
    for entry in table.entries:
        if entry.component != "transformer":
            held.add(entry.component, entry.runner, bucket=entry.bucket, batch=entry.batch)
            continue
        runners = []
        for runner in (entry.runner, *entry.instances):
            options = session_options()
            options.intra_op_num_threads = threads
            session = ort.InferenceSession(str(runner.path), options, providers=["CPUExecutionProvider"])
            runners.append(OnnxRuntimeRunner(runner.path, name=runner.name, session=session))
        held.add(entry.component, runners[0], bucket=entry.bucket, batch=entry.batch, instances=tuple(runners[1:]))
    return held


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(BUCKETS), default="mid")
    parser.add_argument("--target", choices=("onnxruntime", "openvino"), default="onnxruntime")
    parser.add_argument("--workdir", type=Path, default=Path("build/bench-cfg-parallel"))
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs: at least 5 (the medians need them)")

    from trt_diffusion import api
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.metrics import video_metrics
    from trt_diffusion.runtime.engines import RunnerTable
    from trt_diffusion.runtime.loader import engine_runners
    from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    folder = model_folder(work, args.size)
    bucket = BUCKETS[args.size]
    config_path = engines(work, folder, bucket, args.target)
    start = time.perf_counter()
    report = api.build(config_path, target=args.target)
    if report.failed:
        raise SystemExit(f"build failed: {[o.error for o in report.failed]}")
    print(f"build (cached when unchanged): {time.perf_counter() - start:.1f} s")

    config = load_engines_file(config_path)
    model_dir, family, table = engine_runners(config, "wan", args.target)  # two transformer sessions: cfg parallel
    batched_table = RunnerTable([e for e in table.entries if e.component != "transformer" or e.batch == 2])
    cores = len(os.sched_getaffinity(0))
    cases = {"split": EnginePipeline(model_dir, family, table),
             "parallel": EnginePipeline(model_dir, family, table, cfg=("parallel",))}
    share = max(1, cores // 2)
    held = threads_held(table, share, args.target)
    if held is not None:  # the cores shared out; split at the same thread count tells that from ORT's own costs
        cases[f"split, {share} thread(s)"] = EnginePipeline(model_dir, family, held)
        cases[f"parallel, {share} thread(s) per session"] = EnginePipeline(model_dir, family, held, cfg=("parallel",))
    cases["batched"] = EnginePipeline(model_dir, family, batched_table)

    width, height, frames = (int(v) for v in bucket.split("x"))
    request = GenerationRequest("a red fox running through snow", height, width, steps=args.steps,
                                guidance_scale=5.0, seed=0, frames=frames)
    videos = {name: pipe.generate(request) for name, pipe in cases.items()}  # warm-up, and the videos to compare
    for name, generation in videos.items():
        expected = "batched" if name == "batched" else name.split(",")[0]
        assert generation.cfg_mode == expected, (name, generation.cfg_mode)
        if name != "batched":
            np.testing.assert_array_equal(generation.images, videos["split"].images)
    batched_psnr = video_metrics(videos["split"].images[0], videos["batched"].images[0]).min_psnr_db

    denoise: dict[str, list[float]] = {name: [] for name in cases}
    step: dict[str, list[float]] = {name: [] for name in cases}
    load_before = os.getloadavg()[0]  # other work on the host's cores shows here, and in every figure below
    for _ in range(args.runs):  # interleaved: each round runs every case once
        for name, pipe in cases.items():
            timings = pipe.generate(request).timings
            denoise[name].append(sum(timings.step_s))
            step[name] += timings.step_s

    load = (load_before, os.getloadavg()[0])
    call_ms = transformer_call_ms(table, request, folder)
    print(f"\nCPU: {platform.processor() or platform.machine()} ({cpu_name()}), {cores} cores for this process "
          f"(1-min load average {load[0]:.1f} before the rounds, {load[1]:.1f} after); {args.target}; wan "
          f"{args.size} at {bucket}, {args.steps} steps, guidance 5; one batch-1 transformer call {call_ms:.1f} ms "
          f"alone; {args.runs} interleaved rounds")
    print(f"{'case':<36}{'denoise (median)':>18}{'step (median)':>16}{'vs split':>10}")
    base = statistics.median(denoise["split"])
    results = {}
    for name in cases:
        median = statistics.median(denoise[name])
        results[name] = {"denoise_s": median, "step_ms": statistics.median(step[name]) * 1000,
                         "speedup_vs_split": base / median, "rounds": denoise[name]}
        print(f"{name:<36}{median * 1000:>15.1f} ms{results[name]['step_ms']:>13.1f} ms{base / median:>9.2f}x")
    print(f"videos: parallel == split bit for bit; batched vs split: worst frame PSNR {batched_psnr:.1f} dB")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "cores": cores, "load_average": load,
                                         "target": args.target, "size": args.size,
                                         "bucket": bucket, "steps": args.steps, "runs": args.runs,
                                         "transformer_call_ms": call_ms, "batched_psnr_db": batched_psnr,
                                         "cases": results}, indent=2))


def transformer_call_ms(table, request, folder: Path) -> float:
    """One batch-1 transformer call alone (median of 5), for scale."""
    from trt_diffusion.engines_file.engine_spec import Size

    size = Size(request.width, request.height, request.frames)
    runner = table.find("transformer", size=size, batch=1)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    text = runner.inputs["encoder_hidden_states"].shape
    frames = (request.frames - 1) // 4 + 1
    feeds = {"hidden_states": np.zeros((1, config["in_channels"], frames, request.height // 8, request.width // 8),
                                       np.float32),
             "timestep": np.full((1,), 999.0, np.float32),
             "encoder_hidden_states": np.zeros((1, text[1] if isinstance(text[1], int) else 512, config["text_dim"]),
                                               np.float32)}
    runner.run(feeds)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        runner.run(feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


if __name__ == "__main__":
    main()
