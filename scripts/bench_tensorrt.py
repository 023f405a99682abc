"""TensorRT vs PyTorch fp16 on full-size SD1.5 and SDXL UNets (random weights, downloads nothing), into one JSON.

    .venv/bin/python scripts/bench_tensorrt.py --work build/gpu_check --out build/gpu_check.json
    scripts/gpu_check.sh                     # the gpu suite first, then this, into the same JSON

Per (model, resolution): the UNet in fp16 on the GPU (PyTorch eager, median step latency, peak memory), its
fp16 ONNX (fp32 I/O, static shapes, legacy exporter), a strongly typed TensorRT engine (build seconds, plan
bytes), and the production runner on it (eager and CUDA-graph median latency, activation memory, device memory
taken, max |TensorRT - PyTorch|). Batch 2: one classifier-free-guidance step. SD1.5 comes from
`trt-diffusion models tiny --size full`, SDXL from `--family sdxl --size full` (random weights). docs/tensorrt-runtime.md documents the JSON
(docs/tensorrt-runtime.schema.json is its JSON Schema); `--test-gpu-*` fold `make test-gpu`'s result in.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA_VERSION = 1
RESOLUTIONS = (512, 1024)
BATCH = 2  # cond + uncond in one call
# stabilityai/stable-diffusion-xl-base-1.0's UNet config (2.6B parameters)
def _utc() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def test_gpu_section(rc: int | None, log: Path | None, junit: Path | None) -> dict | None:
    if rc is None:
        return None
    section: dict = {"exit_code": rc, "log": str(log) if log else None, "passed": 0, "failed": 0, "skipped": 0,
                     "errors": 0, "failures": [], "skips": [], "stopped_with": None}
    if junit is not None and junit.is_file():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None:
                section["failed"] += 1
                section["failures"].append(name)
            elif case.find("error") is not None:
                section["errors"] += 1
                section["failures"].append(name)
            elif case.find("skipped") is not None:
                section["skipped"] += 1
                section["skips"].append({"test": name, "reason": case.find("skipped").get("message", "")})
            else:
                section["passed"] += 1
    elif log is not None and log.is_file():  # stopped before pytest: host_check's one line says why
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("make test-gpu:")]
        section["stopped_with"] = lines[-1] if lines else None
    return section


def host_section() -> dict:
    host: dict = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        host["torch"] = torch.__version__
        host["torch_cuda"] = torch.version.cuda
    except ImportError:
        host["torch"] = None
    try:
        from trt_diffusion.targets.tensorrt.engine import host_info

        trt_version, capability, name = host_info()
        host.update(tensorrt=trt_version, gpu=name, compute_capability=list(capability))
        from trt_diffusion.targets.tensorrt.cudart import Cuda

        host["gpu_memory_bytes"] = Cuda().mem_get_info()[1]
    except Exception as err:  # noqa: BLE001 - recorded, the benchmark is then skipped
        host["unavailable"] = f"{type(err).__name__}: {err}"
    try:
        host["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        host["driver"] = None
    return host


def load_unet(family: str, work: Path):
    """(UNet module in fp32 on the CPU, where it came from)."""
    from diffusers import UNet2DConditionModel

    folder = work / f"{family}-full"
    command = [sys.executable, "-m", "trt_diffusion", "models", "tiny", "--family", family, "--size", "full",
               "--out", str(folder), "--if-missing"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")
    return UNet2DConditionModel.from_pretrained(folder / "unet"), f"trt-diffusion models tiny --family {family} --size full"


class UNetIO:
    """fp32 inputs and output around the fp16 UNet; named as the project's unet component."""

    def __init__(self, family: str, resolution: int, unet):
        self.family, self.latent = family, resolution // 8
        self.hidden = unet.config.cross_attention_dim
        self.names = ["sample", "timestep", "encoder_hidden_states"] + (["text_embeds", "time_ids"] if family == "sdxl" else [])

    def feeds(self, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        feeds = {"sample": rng.standard_normal((BATCH, 4, self.latent, self.latent)),
                 "timestep": np.full((BATCH,), 500.0),
                 "encoder_hidden_states": rng.standard_normal((BATCH, 77, self.hidden))}
        if self.family == "sdxl":
            size = self.latent * 8
            feeds["text_embeds"] = rng.standard_normal((BATCH, 1280))
            feeds["time_ids"] = np.array([[size, size, 0, 0, size, size]] * BATCH)
        return {k: v.astype(np.float32) for k, v in feeds.items()}


def wrapper(unet, io: UNetIO):
    import torch

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unet = unet

        def forward(self, sample, timestep, encoder_hidden_states, text_embeds=None, time_ids=None):
            extra = {}
            if text_embeds is not None:
                extra["added_cond_kwargs"] = {"text_embeds": text_embeds.half(), "time_ids": time_ids.half()}
            out = self.unet(sample.half(), timestep.half(), encoder_hidden_states=encoder_hidden_states.half(),
                            return_dict=False, **extra)[0]
            return out.float()

    return Wrapped().eval()


def median_seconds(fn, runs: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_one(family: str, resolution: int, unet, source: str, work: Path, runs: int) -> dict:
    import torch

    from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
    from trt_diffusion.targets.tensorrt import engine as trt_engine
    from trt_diffusion.targets.tensorrt.manifest import engine_path
    from trt_diffusion.targets.tensorrt.runner import EngineGroup, TensorRTRunner

    io = UNetIO(family, resolution, unet)
    feeds = io.feeds()
    result: dict = {"model": f"{family}-unet", "source": source, "resolution": resolution, "batch": BATCH,
                    "latent": [io.latent, io.latent], "precision": "fp16",
                    "parameters": int(sum(p.numel() for p in unet.parameters()))}
    # PyTorch fp16 eager on the GPU
    module = wrapper(unet.half().cuda(), io)
    device_feeds = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        reference = module(*[device_feeds[n] for n in io.names])
        result["pytorch_fp16_s"] = median_seconds(lambda: module(*[device_feeds[n] for n in io.names]), runs)  # noqa: F821 (called before the del below)
    result["pytorch_peak_memory_bytes"] = int(torch.cuda.max_memory_allocated())
    # fp16 ONNX, exported on the GPU, static shapes
    onnx_dir = work / "onnx" / f"{family}-{resolution}"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = onnx_dir / "unet.onnx"
    started = time.perf_counter()
    with torch.inference_mode():
        torch.onnx.export(module, tuple(device_feeds[n] for n in io.names), str(onnx_path), input_names=io.names,
                          output_names=["noise_pred"], opset_version=17, dynamo=False)
    result["export_s"] = time.perf_counter() - started
    module.cpu()
    del module, device_feeds
    gc.collect()
    torch.cuda.empty_cache()
    # the engine
    spec = EngineSpec(model=f"bench-{family}", family=family, source=source, component="unet", target="tensorrt",
                      precision="fp16", batch=BATCH, bucket=Bucket.static(Size(resolution, resolution)),
                      build_options=(("tensorrt_optimization_level", 3), ("tensorrt_workspace_gb", 16)))
    profile = {n: (tuple(v.shape),) * 3 for n, v in feeds.items()}
    plan = engine_path(work, spec)
    manifest = trt_engine.build_engine(onnx_path, spec, profile, plan, work / "timing-cache")
    result.update(build_s=manifest.build_seconds, plan_bytes=manifest.plan_bytes, tensorrt_version=manifest.tensorrt_version)
    # the production runner: eager, then CUDA graphs
    device_feeds = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    for mode, graphs in (("eager", False), ("cuda_graph", True)):
        group = EngineGroup()
        free_before = group.cuda.mem_get_info()[0]
        with TensorRTRunner(plan, group=group, cuda_graph=graphs) as runner:
            result[f"tensorrt_{mode}_s"] = median_seconds(lambda: runner.run(device_feeds), runs)
            result["tensorrt_device_memory_bytes"] = free_before - group.cuda.mem_get_info()[0]
            result["tensorrt_activation_bytes"] = group.activation_bytes
            out = runner.run(device_feeds)["noise_pred"]
            result[f"max_abs_diff_vs_pytorch_{mode}"] = float((out - reference).abs().max())
            result[f"graph_captures_{mode}"] = runner.stats.graph_captures
    result["speedup_eager"] = result["pytorch_fp16_s"] / result["tensorrt_eager_s"]
    result["speedup_cuda_graph"] = result["pytorch_fp16_s"] / result["tensorrt_cuda_graph_s"]
    return result


def benchmarks(work: Path, runs: int, families: list[str], resolutions: list[int]) -> tuple[list[dict], str | None]:
    from trt_diffusion.targets.tensorrt.host_check import missing

    problems = missing()
    try:
        import torch

        if not torch.cuda.is_available():
            problems.append(f"torch has no CUDA (build: CUDA {torch.version.cuda or 'none'}): the PyTorch fp16 baseline needs it")
    except ImportError:
        problems.append("torch is not installed")
    if problems:
        return [], "; ".join(problems)
    results = []
    for family in families:
        try:
            unet, source = load_unet(family, work)
        except Exception as err:  # noqa: BLE001 - one model failing leaves the other's figures
            results += [{"model": f"{family}-unet", "resolution": r, "error": f"{type(err).__name__}: {err}"} for r in resolutions]
            continue
        for resolution in resolutions:
            try:
                results.append(bench_one(family, resolution, unet.float().cpu(), source, work, runs))
            except Exception as err:  # noqa: BLE001
                results.append({"model": f"{family}-unet", "resolution": resolution,
                                "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]})
            gc.collect()
        del unet
    return results, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "gpu_check")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu_check.json")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--family", action="append", choices=["sd15", "sdxl"])
    parser.add_argument("--resolution", action="append", type=int)
    parser.add_argument("--no-benchmark", action="store_true", help="only fold in the gpu suite's result")
    parser.add_argument("--test-gpu-rc", type=int)
    parser.add_argument("--test-gpu-log", type=Path)
    parser.add_argument("--junit", type=Path)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    started = _utc()
    if args.no_benchmark:
        results, skipped = [], "--no-benchmark"
    else:
        results, skipped = benchmarks(args.work, args.runs, args.family or ["sd15", "sdxl"],
                                      args.resolution or list(RESOLUTIONS))
    report = {"schema_version": SCHEMA_VERSION, "started_at": started, "finished_at": _utc(), "host": host_section(),
              "test_gpu": test_gpu_section(args.test_gpu_rc, args.test_gpu_log, args.junit),
              "benchmarks": results, "benchmark_skipped": skipped}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    failed = (report["test_gpu"] or {}).get("exit_code", 0) != 0 or skipped not in (None, "--no-benchmark") \
        or any("error" in r for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
