"""Every CPU route side by side, on the full-size SD1.5 architecture (random weights).

Routes: PyTorch fp32 eager, PyTorch bf16 autocast, the project's onnxruntime engines (fp32, int8 Q/DQ),
OpenVINO's defaults on the plain ONNX (`core.compile_model(onnx)`, nothing set), and the project's openvino
engines (fp32, bf16, int8). Workloads: the UNet (batch 2 for CFG) at 256² and 512², the VAE decoder, and
(`--pipeline`) one whole 512² denoising loop of 10 steps + decode.

Each route is loaded alone (the previous one freed first), rounds are interleaved (route A, B, C, ... then
again) so every route sees the same machine load, and each timed call follows an untimed one in the same
load. Reported: the median of `--runs` (>= 5) rounds, the speed-up over PyTorch fp32 measured in this run,
and the PSNR of the output vs PyTorch fp32 on the same inputs. A route this CPU cannot run honestly (bf16
without AMX/AVX512-BF16) is listed with the reason. `--profile-ort-int8` adds ONNX Runtime's profile of
its int8 engine: time per operator type, and how many Q/DQ nodes were left unfused.

The fraction of the CPU's peak each UNet route reaches (issue 47, acceptance 3): the FLOPs of one PyTorch UNet call
(torch's `FlopCounterMode`: matmuls, convolutions and the CPU attention kernel) ÷ the route's median time, against cores × base GHz × FLOPs
per cycle per core of the route's arithmetic (`PEAK_FLOPS_PER_CYCLE`: AMX where the CPU has it, else AVX-512, else
AVX2). The base clock is the model name's "@ x.xxGHz" where it has one, else /proc/cpuinfo's "cpu MHz" (a guest's
view; `--base-ghz` overrides it); the table names which.

    python scripts/bench_cpu.py [--sizes 256 512] [--vae] [--pipeline] [--runs 5] [--workdir DIR] [--json F]

Needs about 12 GB of memory at 512² (one route at a time) and no GPU or network.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SEED = 0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def psnr(reference: np.ndarray, candidate: np.ndarray) -> float:
    reference, candidate = np.asarray(reference, np.float64), np.asarray(candidate, np.float64)
    mse = float(np.mean((reference - candidate) ** 2))
    peak = float(np.max(np.abs(reference)))
    return float("inf") if mse == 0 else 10 * np.log10(peak ** 2 / mse)


@dataclass
class Route:
    name: str
    load: Callable[[], Callable[[dict], np.ndarray]]  # -> run(feeds) -> output
    unavailable: str | None = None


# ------------------------------------------------------------------------------------------- models


def full_model(workdir: Path) -> Path:
    from trt_diffusion.models.tiny import write_tiny_model

    folder = workdir / "sd15-full"
    if not (folder / "model_index.json").is_file():
        log("writing the full-size sd15 folder (random weights)")
        write_tiny_model(folder, "sd15", size="full")
    return folder


def full_vae(model_dir: Path, workdir: Path) -> Path:
    """A folder whose vae/ is the real SD1.5 AutoencoderKL architecture (84M parameters, seeded random
    weights): `models tiny --size full` makes only the UNet full-size."""
    import torch
    from diffusers import AutoencoderKL

    config = json.loads((model_dir / "vae" / "config.json").read_text())
    if config.get("block_out_channels") == [128, 256, 512, 512]:
        return model_dir
    folder = workdir / "sd15-full-vae"
    if not (folder / "vae" / "config.json").is_file():
        log("writing a full-size SD1.5 VAE (random weights)")
        torch.manual_seed(SEED)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            layers_per_block=2, norm_num_groups=32, sample_size=512, scaling_factor=0.18215)
        vae.save_pretrained(folder / "vae")
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                              "vae": ["diffusers", "AutoencoderKL"]}))
    return folder


def unet_feeds(latent: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    return {"sample": rng.standard_normal((2, 4, latent, latent)).astype(np.float32),
            "timestep": np.array([500.0, 500.0], np.float32),
            "encoder_hidden_states": rng.standard_normal((2, 77, 768)).astype(np.float32)}


def vae_feeds(latent: int) -> dict[str, np.ndarray]:
    return {"latent": np.random.default_rng(SEED).standard_normal((1, 4, latent, latent)).astype(np.float32)}


class UNetWrapper:
    def __init__(self, unet):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.unet = unet

            def forward(self, sample, timestep, encoder_hidden_states):
                return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]

        self.module = Wrapped().eval()


class VaeWrapper:
    def __init__(self, vae):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.vae = vae

            def forward(self, latent):
                return self.vae.decode(latent, return_dict=False)[0]

        self.module = Wrapped().eval()


# FLOPs per cycle per core at full width: the figures for AMX-BF16/AMX-INT8/AVX-512 fp32 (two 512-bit FMA
# ports); AVX512-BF16 (vdpbf16ps: 32 products per instruction) and AVX512-VNNI (vpdpbusd: 64) on the same two ports.
# A Zen 4 core executes 512-bit operations on 256-bit units (half these rates): its fractions read twice as high.
PEAK_FLOPS_PER_CYCLE = {"amx_bf16": 1024, "amx_int8": 2048, "avx512_fp32": 64, "avx512_bf16": 128,
                        "avx512_vnni_int8": 256, "avx2_fp32": 32, "avx2_vnni_int8": 128}


def peak_unit(route: str, flags: set[str]) -> str:
    """The arithmetic a route's matmuls run on this CPU: its precision, on the widest unit the CPU has for it."""
    if "int8" in route:
        return ("amx_int8" if "amx_int8" in flags else "avx512_vnni_int8" if "avx512_vnni" in flags
                else "avx2_vnni_int8")
    # OpenVINO's defaults compute bf16 where the CPU does (its INFERENCE_PRECISION_HINT: bfloat16 on AVX512-BF16/AMX)
    if "bf16" in route or ("defaults" in route and flags & {"amx_bf16", "avx512_bf16"}):
        return "amx_bf16" if "amx_bf16" in flags else "avx512_bf16"
    return "avx512_fp32" if "avx512f" in flags else "avx2_fp32"


def base_ghz(override: float | None) -> tuple[float, str]:
    import re

    if override:
        return override, "--base-ghz"
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    named = re.search(r"model name\s*:.*@\s*([0-9.]+)\s*GHz", cpuinfo)
    if named:
        return float(named.group(1)), "model name"
    mhz = re.search(r"cpu MHz\s*:\s*([0-9.]+)", cpuinfo)
    if mhz:
        return float(mhz.group(1)) / 1000, "/proc/cpuinfo cpu MHz"
    raise SystemExit("no base clock found in /proc/cpuinfo: give --base-ghz")


def unet_flops(model_dir: Path, feeds: dict) -> int:
    """FLOPs of one UNet call on these inputs, as torch's FlopCounterMode counts them (2 per multiply-add)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_attention(query_shape, key_shape, value_shape, *_, out_shape=None, **__):
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    module = load_torch(model_dir, "unet")
    # torch 2.13's counter knows the CUDA attention kernels, not the CPU one: uncounted, attention is 0 FLOPs
    attention = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_attention}
    counter = FlopCounterMode(display=False, custom_mapping=attention)
    with torch.inference_mode(), counter:
        module(*[torch.from_numpy(value) for value in feeds.values()])
    return int(counter.get_total_flops())


def add_peak_fractions(rows: list[dict], flops: int, cores: int, ghz: float, flags: set[str]) -> None:
    for row in rows:
        if "median_s" not in row:
            continue
        unit = peak_unit(row["route"], flags)
        peak = cores * ghz * 1e9 * PEAK_FLOPS_PER_CYCLE[unit]
        row.update(tflops=round(flops / row["median_s"] / 1e12, 3), peak_unit=unit,
                   peak_tflops=round(peak / 1e12, 3), peak_fraction=round(flops / row["median_s"] / peak, 4))


def load_torch(model_dir: Path, component: str):
    from trt_diffusion.families import Component
    from trt_diffusion.models.loading import load_component

    module = load_component(model_dir, Component(component)).eval()
    return (UNetWrapper(module) if component == "unet" else VaeWrapper(module)).module


def export_onnx(model_dir: Path, component: str, feeds: dict, out: Path) -> Path:
    """Plain fp32 ONNX (legacy exporter, dynamic spatial dims), the graph every ONNX route starts from."""
    import torch

    if out.is_file():
        return out
    log(f"exporting the {component} to ONNX")
    module = load_torch(model_dir, component)
    out.parent.mkdir(parents=True, exist_ok=True)
    names = list(feeds)
    axes = {n: {0: "batch", 2: "h", 3: "w"} for n in names if feeds[n].ndim == 4}
    with torch.inference_mode():
        torch.onnx.export(module, tuple(torch.from_numpy(feeds[n]) for n in names), str(out), input_names=names,
                          output_names=["out"], dynamic_axes={**axes, "out": {0: "batch", 2: "H", 3: "W"}},
                          opset_version=17, dynamo=False)
    del module
    gc.collect()
    return out


def quantized_unet(model_dir: Path, workdir: Path) -> Path:
    """The project's int8 Q/DQ ONNX of the UNet (ModelOpt PTQ, a tiny seeded calibration at 256²)."""
    import yaml

    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.quantize.stage import quantize_component

    path = workdir / "int8.yaml"
    entry = {"source": str(model_dir), "family": "sd15", "components": ["unet"], "precision": {"unet": "int8"},
             "buckets": ["256x256"], "targets": ["onnxruntime"],
             "quantization": {"calibration": {"samples": 2, "steps": 1, "seed": 0}}}
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": str(workdir / "build")},
                                    "models": {"full": entry}}))
    log("int8 PTQ of the UNet (ModelOpt; cached when unchanged)")
    artifact = quantize_component(load_engines_file(path).models["full"], "unet", "int8", None, workdir / "build",
                                  held_out_samples=1, compare_images=False)
    gc.collect()
    return Path(artifact.onnx_path)


# ------------------------------------------------------------------------------------------- routes


def _spec(target: str, component: str, precision: str, size: int, batch: int):
    from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size

    return EngineSpec(model="full", family="sd15", source="local:bench", component=component, target=target,
                      precision=precision, batch=batch, bucket=Bucket.static(Size(size, size)))


def _profile(feeds: dict) -> dict:
    return {name: (value.shape, value.shape, value.shape) for name, value in feeds.items()}


def routes_for(component: str, model_dir: Path, onnx_fp32: Path, onnx_int8: Path | None, feeds: dict, size: int,
               workdir: Path) -> list[Route]:
    import torch

    batch = next(iter(feeds.values())).shape[0]
    names = list(feeds)

    def torch_route(bf16: bool):
        def load():
            module = load_torch(model_dir, component)

            def run(f):
                with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                    return module(*[torch.from_numpy(f[n]) for n in names]).float().numpy()
            return run
        return load

    def ort_route(source: Path, precision: str):
        def load():
            import onnxruntime as ort

            from trt_diffusion.targets import onnxruntime as ort_target

            folder, _, _ = ort_target.build_engine(source, _spec("onnxruntime", component, precision, size, batch),
                                                   _profile(feeds), workdir / "engines")
            options = ort_target.session_options()
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session = ort.InferenceSession(str(folder / ort_target.MODEL_FILE), options,
                                           providers=["CPUExecutionProvider"])
            out = session.get_outputs()[0].name
            return lambda f: session.run([out], f)[0]
        return load

    def ov_defaults():
        import openvino as ov

        model = ov.Core().compile_model(str(onnx_fp32), "CPU")  # what a user gets with nothing set
        return lambda f: np.array(model(f)[model.outputs[0]])

    def ov_route(source: Path, precision: str):
        def load():
            from trt_diffusion.targets.openvino.engine import build_engine, cache_dir
            from trt_diffusion.targets.openvino.host import cpu_facts
            from trt_diffusion.targets.openvino.runner import OpenVINORunner

            folder, _, _ = build_engine(source, _spec("openvino", component, precision, size, batch), _profile(feeds),
                                        workdir / "engines")
            runner = OpenVINORunner(folder, cache=cache_dir(workdir / "engines" / "engines", cpu_facts()))
            out = runner.output_names[0]
            return lambda f: runner.run(f)[out]
        return load

    from trt_diffusion.targets.openvino import host, precision

    def ov_refusal(name: str) -> str | None:
        try:
            precision.resolve(name, host.cpu_facts().capabilities, host.cpu_facts().device_name)
        except Exception as exc:  # noqa: BLE001
            return str(exc).split(":")[0] + ": " + str(exc).split(":", 2)[-1].strip()[:120]
        return None

    from trt_diffusion.targets.openvino import host as ov_host

    # Without bf16 hardware PyTorch's CPU autocast falls back to slow bf16 kernels: one 256² UNet call ran
    # for over 10 minutes on an AVX2-only EPYC (against 13 s in fp32). Not a route anyone would take there.
    torch_bf16_reason = None if "BF16" in ov_host.cpu_facts().capabilities or os.environ.get("BENCH_TORCH_BF16") \
        else "no bf16 hardware (AMX/AVX512-BF16): one call took > 10 min here (BENCH_TORCH_BF16=1 runs it anyway)"
    routes = [Route("pytorch fp32", torch_route(False)),
              Route("pytorch bf16 autocast", torch_route(True), torch_bf16_reason),
              Route("onnxruntime fp32 (project)", ort_route(onnx_fp32, "fp32"))]
    if onnx_int8 is not None:
        routes.append(Route("onnxruntime int8 (project)", ort_route(onnx_int8, "int8")))
    routes += [Route("openvino defaults, plain ONNX", ov_defaults),
               Route("openvino fp32 (project)", ov_route(onnx_fp32, "fp32")),
               Route("openvino bf16 (project)", ov_route(onnx_fp32, "bf16"), ov_refusal("bf16"))]
    if onnx_int8 is not None:
        routes.append(Route("openvino int8 (project)", ov_route(onnx_int8, "int8"), ov_refusal("int8")))
    return routes


def measure(routes: list[Route], feeds: dict, runs: int) -> list[dict]:
    """Interleaved rounds; in each, every route is loaded alone, called once untimed, then timed."""
    times: dict[str, list[float]] = {r.name: [] for r in routes}
    loads: dict[str, list[float]] = {r.name: [] for r in routes}
    outputs: dict[str, np.ndarray] = {}
    failed: dict[str, str] = {}
    for round_index in range(runs):
        for route in routes:
            if route.unavailable or route.name in failed:
                continue
            try:
                started = time.perf_counter()
                run = route.load()
                loads[route.name].append(time.perf_counter() - started)
                run(feeds)
                started = time.perf_counter()
                out = run(feeds)
                times[route.name].append(time.perf_counter() - started)
                outputs.setdefault(route.name, out)
            except Exception as exc:  # noqa: BLE001 - a route that fails is reported, the rest still run
                failed[route.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            finally:
                run = None
                gc.collect()
            if route.name in times and times[route.name]:
                log(f"  round {round_index + 1}/{runs} {route.name}: {times[route.name][-1]:.3f} s "
                    f"(load {loads[route.name][-1]:.1f} s)")
    base = statistics.median(times["pytorch fp32"]) if times.get("pytorch fp32") else None
    reference = outputs.get("pytorch fp32")
    rows = []
    for route in routes:
        row = {"route": route.name}
        if route.unavailable or route.name in failed:
            row["unavailable"] = route.unavailable or failed[route.name]
        else:
            median = statistics.median(times[route.name])
            row.update(median_s=round(median, 3), min_s=round(min(times[route.name]), 3),
                       max_s=round(max(times[route.name]), 3), runs=len(times[route.name]),
                       load_s=round(statistics.median(loads[route.name]), 1),
                       speedup_vs_pytorch_fp32=round(base / median, 2) if base else None,
                       psnr_db_vs_pytorch_fp32=(round(psnr(reference, outputs[route.name]), 1)
                                                if reference is not None and route.name != "pytorch fp32" else None))
        rows.append(row)
    return rows


def profile_ort_int8(workdir: Path, feeds: dict) -> dict:
    """ONNX Runtime's own profile of the int8 engine (one run): time by operator type, and the Q/DQ
    nodes its graph optimizer left in the graph (each one runs as a separate fp32<->int8 conversion)."""
    import onnx
    import onnxruntime as ort

    from trt_diffusion.targets import onnxruntime as ort_target

    folder = next(p for p in (workdir / "engines" / "engines" / "onnxruntime").iterdir() if ".int8." in p.name)
    options = ort_target.session_options()
    options.enable_profiling = True
    options.profile_file_prefix = str(workdir / "ort-int8-profile")
    options.optimized_model_filepath = str(workdir / "ort-int8-optimized.onnx")
    session = ort.InferenceSession(str(folder / ort_target.MODEL_FILE), options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    session.run(None, feeds)
    trace = json.loads(Path(session.end_profiling()).read_text())
    by_op: dict[str, float] = {}
    runs = [e for e in trace if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    for event in runs[len(runs) // 2:]:  # the second run
        op = event.get("args", {}).get("op_name", "?")
        by_op[op] = by_op.get(op, 0.0) + event["dur"] / 1e6
    optimized = onnx.load(str(workdir / "ort-int8-optimized.onnx"), load_external_data=False)
    ops: dict[str, int] = {}
    for node in optimized.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    total = sum(by_op.values())
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:10]
    return {"total_kernel_s": round(total, 3),
            "by_op_type_s": {k: round(v, 3) for k, v in top},
            "share": {k: round(v / total, 3) for k, v in top},
            "optimized_graph_op_counts": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:15])}


def refit_timing(workdir: Path, onnx_fp32: Path, size: int) -> dict:
    """LoRA refit on the openvino target: replacing the weight Constants of the built IR and compiling, vs a
    fused rebuild from an ONNX that already holds the fused weights (convert + reshape + save + compile:
    the rebuild's lower bound, export excluded). Every 2-D MatMul weight (attention and feed-forward
    projections, what LoRAs touch) is replaced by a perturbed copy."""
    import openvino as ov

    from trt_diffusion.targets.openvino.engine import build_engine, compile_config
    from trt_diffusion.targets.openvino.precision import Compute
    from trt_diffusion.targets.openvino.runner import replace_constants

    feeds = unet_feeds(size // 8)
    folder, manifest, _ = build_engine(onnx_fp32, _spec("openvino", "unet", "fp32", size, 2), _profile(feeds),
                                       workdir / "engines")
    config = compile_config(Compute("f32", None, "f32"), None)
    core = ov.Core()
    started = time.perf_counter()
    model = core.read_model(str(folder / "model.xml"))
    arrays = {}
    for op in model.get_ops():
        if op.get_type_name() != "Constant" or len(op.get_output_shape(0)) != 2:
            continue
        if any(t.get_node().get_type_name() == "MatMul" for t in op.output(0).get_target_inputs()):
            name = next(iter(op.output(0).get_names()), None)
            if name:
                arrays[name] = (op.get_data() * 1.01).astype(np.float32)
    replaced = replace_constants(model, arrays, tuple(arrays))
    read_replace_s = time.perf_counter() - started
    compiled = core.compile_model(model, "CPU", config)
    refit_s = time.perf_counter() - started
    del compiled, model
    gc.collect()
    started = time.perf_counter()
    model = ov.convert_model(str(onnx_fp32))
    model.reshape({port: ov.PartialShape(list(feeds[name].shape)) for name in feeds
                   for port in model.inputs if name in port.get_names()})
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        ov.save_model(model, f"{tmp}/model.xml", compress_to_fp16=False)
        del model
        compiled = core.compile_model(core.read_model(f"{tmp}/model.xml"), "CPU", config)
        rebuild_s = time.perf_counter() - started
        del compiled
    gc.collect()
    return {"weights_replaced": replaced, "replaced_bytes": int(sum(a.nbytes for a in arrays.values())),
            "constant_replacement_s": round(refit_s, 1), "of_which_read_and_replace_s": round(read_replace_s, 1),
            "fused_rebuild_s": round(rebuild_s, 1)}


def pipeline_routes(model_dir: Path, workdir: Path, onnx_unet: Path, onnx_int8: Path | None, onnx_vae: Path,
                    steps: int) -> tuple[list[Route], dict]:
    """One 512² text-to-image loop (CFG batch 2, `steps` DDIM steps, VAE decode) over PyTorch fp32 modules or
    the project's openvino engines; fixed text embeddings (the text encoder is a negligible share)."""
    import torch
    from diffusers import DDIMScheduler

    feeds = unet_feeds(64)
    latents0 = feeds["sample"][:1]
    text = feeds["encoder_hidden_states"]
    scheduler_dir = model_dir / "scheduler"

    def loop(unet, vae):
        scheduler = DDIMScheduler.from_pretrained(scheduler_dir)
        scheduler.set_timesteps(steps)
        latents = latents0.copy()
        for t in scheduler.timesteps:
            model_in = np.concatenate([latents, latents])
            noise = unet({"sample": model_in, "timestep": np.array([float(t)] * 2, np.float32),
                          "encoder_hidden_states": text})
            uncond, cond = noise[:1], noise[1:]
            guided = uncond + 7.5 * (cond - uncond)
            latents = scheduler.step(torch.from_numpy(guided), t, torch.from_numpy(latents)).prev_sample.numpy()
        return vae({"latent": (latents / 0.18215).astype(np.float32)})

    def torch_load():
        unet, vae = load_torch(model_dir, "unet"), load_torch(full_vae(model_dir, workdir), "vae_decoder")

        def call(module):
            def run(f):
                with torch.inference_mode():
                    return module(*[torch.from_numpy(v) for v in f.values()]).numpy()
            return run
        return lambda _: loop(call(unet), call(vae))

    def ov_load(unet_source: Path, precision: str):
        def load():
            from trt_diffusion.targets.openvino.engine import build_engine, cache_dir
            from trt_diffusion.targets.openvino.host import cpu_facts
            from trt_diffusion.targets.openvino.runner import OpenVINORunner

            engines = workdir / "engines"
            cache = cache_dir(engines / "engines", cpu_facts())
            unet_dir, _, _ = build_engine(unet_source, _spec("openvino", "unet", precision, 512, 2),
                                          _profile(feeds), engines)
            vae_precision = "bf16" if precision == "bf16" else "fp32"
            vae_dir, _, _ = build_engine(onnx_vae, _spec("openvino", "vae_decoder", vae_precision, 512, 1),
                                         _profile(vae_feeds(64)), engines)
            unet = OpenVINORunner(unet_dir, cache=cache)
            vae = OpenVINORunner(vae_dir, cache=cache)
            return lambda _: loop(lambda f: unet.run(f)[unet.output_names[0]], lambda f: vae.run(f)[vae.output_names[0]])
        return load

    routes = [Route("pytorch fp32", torch_load), Route("openvino fp32 (project)", ov_load(onnx_unet, "fp32"))]
    from trt_diffusion.targets.openvino import host

    bf16 = None if "BF16" in host.cpu_facts().capabilities else "bf16: this CPU has no AMX-BF16/AVX512-BF16"
    routes.append(Route("openvino bf16 (project)", ov_load(onnx_unet, "bf16"), bf16))
    if onnx_int8 is not None:
        routes.append(Route("openvino int8 unet + fp32 vae (project)", ov_load(onnx_int8, "int8")))
    return routes, {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[256, 512], help="UNet image sizes (latents /8)")
    parser.add_argument("--vae", action=argparse.BooleanOptionalAction, default=True, help="the VAE decoder")
    parser.add_argument("--vae-size", type=int, default=256)
    parser.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=True,
                        help="one 512² pipeline, 10 steps")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-int8", action="store_true", help="skip the ModelOpt int8 PTQ (about 2-3 minutes)")
    parser.add_argument("--profile-ort-int8", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--refit", action=argparse.BooleanOptionalAction, default=True,
                        help="time the openvino LoRA refit against a fused rebuild (UNet at the first size)")
    parser.add_argument("--workdir", type=Path, default=None, help="kept between runs (models, ONNX, engines)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--base-ghz", type=float, default=None, help="the CPU's base clock (peak fractions)")
    parser.add_argument("--routes", nargs="*", default=None,
                        help="UNet routes whose name holds one of these words (pytorch fp32 always runs: the base)")
    args = parser.parse_args()
    if args.runs < 5:
        print("--runs must be at least 5 (medians of fewer are noise on a shared machine)", file=sys.stderr)
        return 2
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="bench-cpu-"))).resolve()  # engines.yaml paths: absolute
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    from trt_diffusion.targets.openvino import host

    facts = host.cpu_facts()
    report: dict = {"cpu": facts.device_name, "cpu_capabilities": list(facts.capabilities),
                    "isa_flags": list(facts.isa_flags), "cores": host.available_cores(),
                    "load_average_start": os.getloadavg(), "openvino": facts.openvino_version,
                    "python": platform.python_version(), "runs": args.runs, "results": {}}
    log(f"{facts.device_name}: {facts.capabilities}, flags {facts.isa_flags}; load {os.getloadavg()}")
    model_dir = full_model(workdir)
    unet_onnx = export_onnx(model_dir, "unet", unet_feeds(32), workdir / "onnx" / "unet" / "model.onnx")
    int8_onnx = None if args.no_int8 else quantized_unet(model_dir, workdir)
    for size in args.sizes:
        feeds = unet_feeds(size // 8)
        log(f"UNet {size}² (batch 2, {size // 8}² latents)")
        routes = [r for r in routes_for("unet", model_dir, unet_onnx, int8_onnx, feeds, size, workdir)
                  if not args.routes or r.name == "pytorch fp32" or any(w in r.name for w in args.routes)]
        report["results"][f"unet_{size}"] = measure(routes, feeds, args.runs)
        flops = unet_flops(model_dir, feeds)
        ghz, ghz_source = base_ghz(args.base_ghz)
        add_peak_fractions(report["results"][f"unet_{size}"], flops, report["cores"], ghz, set(facts.isa_flags))
        report[f"unet_{size}_flops"] = {"flops": flops, "base_ghz": ghz, "base_ghz_source": ghz_source}
        _print(f"UNet {size}² ({flops / 1e9:.0f} GFLOP per call; {report['cores']} cores × {ghz:.2f} GHz "
               f"from {ghz_source})", report["results"][f"unet_{size}"])
        if args.profile_ort_int8 and int8_onnx is not None and size == args.sizes[0]:
            report["ort_int8_profile"] = profile_ort_int8(workdir, feeds)
            log(f"ONNX Runtime int8 profile: {report['ort_int8_profile']}")
    if args.refit and args.sizes:
        log("openvino refit: weight constants replaced vs a fused rebuild")
        report["openvino_refit"] = refit_timing(workdir, unet_onnx, args.sizes[0])
        log(f"  {report['openvino_refit']}")
    vae_onnx = None
    vae_dir = full_vae(model_dir, workdir) if (args.vae or args.pipeline) else model_dir
    if args.vae or args.pipeline:
        vae_onnx = export_onnx(vae_dir, "vae_decoder", vae_feeds(32), workdir / "onnx" / "vae-full" / "model.onnx")
    if args.vae:
        feeds = vae_feeds(args.vae_size // 8)
        log(f"VAE decoder -> {args.vae_size}²")
        routes = routes_for("vae_decoder", vae_dir, vae_onnx, None, feeds, args.vae_size, workdir)
        report["results"][f"vae_decoder_{args.vae_size}"] = measure(routes, feeds, args.runs)
        _print(f"VAE decoder {args.vae_size}²", report["results"][f"vae_decoder_{args.vae_size}"])
    if args.pipeline:
        log(f"pipeline 512², {args.steps} steps")
        routes, _ = pipeline_routes(model_dir, workdir, unet_onnx, int8_onnx, vae_onnx, args.steps)
        report["results"]["pipeline_512"] = measure(routes, {}, args.runs)
        _print(f"pipeline 512², {args.steps} steps", report["results"]["pipeline_512"])
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["load_average_end"] = os.getloadavg()
    log(f"done in {report['seconds']} s; load {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _print(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'route':40} {'median s':>9} {'min':>7} {'max':>7} {'x pt32':>7} {'PSNR dB':>8} {'TFLOP/s':>8} "
          f"{'of peak':>8}  unit")
    for row in rows:
        if "unavailable" in row:
            print(f"{row['route']:40} {row['unavailable']}")
        else:
            peak = (f" {row['tflops']:8.3f} {row['peak_fraction']:8.1%}  {row['peak_unit']} "
                    f"({row['peak_tflops']} TFLOP/s)" if "peak_fraction" in row else "")
            print(f"{row['route']:40} {row['median_s']:9.3f} {row['min_s']:7.3f} {row['max_s']:7.3f} "
                  f"{row['speedup_vs_pytorch_fp32'] or 0:7.2f} {row['psnr_db_vs_pytorch_fp32'] or float('nan'):8.1f}"
                  f"{peak}")
    print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
