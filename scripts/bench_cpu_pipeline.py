"""Whole-pipeline CPU images against what a CPU user would run instead (issue 47, acceptance 2).

Speed (`--stage speed`): the SD1.5 architecture (`--size full`: the project's full-size folder with random weights,
bench_cpu.py's `full_model`; `--size tiny` for a smoke run), one image = text encoder + `--steps` UNet steps with
CFG (the UNet at batch 2) + VAE decode, at `--resolution`², through

- diffusers `StableDiffusionPipeline` eager, fp32 and bf16 (`dtype=torch.bfloat16`; only where the CPU computes bf16
  natively, AMX-BF16 or AVX512-BF16: elsewhere PyTorch's bf16 kernels are emulated and a route nobody would take),
- optimum-intel's `OVStableDiffusionPipeline` in its own venv (below): the folder exported by optimum's own exporter
  (`optimum-cli export openvino --task text-to-image --weight-format fp32`), `reshape(batch_size=1, height, width,
  num_images_per_prompt=1)` to static shapes, `compile()`, optimum's default ov_config (LATENCY hint),
- the project's routes, declared in an engines.yaml this script writes, built by `api.build` and run by the
  in-process `EnginePipeline` on the openvino target, text encoder and VAE decoder on the same target: fp32; bf16
  (where honest, as above); the int8 UNet (ModelOpt Q/DQ; text encoder + VAE in bf16 where honest, else fp32); the
  int8 UNet with DeepCache (branch 0) at interval 2 and 3 (its quantized pieces, issue 47).

Every measurement is its own process (`--worker`; the optimum route through the venv's python): load, one untimed
warm-up image of `--warmup-steps` steps at the same size, then one timed image. Routes are interleaved (A, B, C, ...
then again) `--repeats` times (median of 5 by default), so a drift of the machine touches every route alike.
Reported: median s/image, the ratio against optimum-intel and against diffusers fp32, the CPU (lscpu model name,
AMX or not, cores).

Quality (`--stage quality`, `--stage step-cache`): the trained SD1.5 micro-model (trt_diffusion/data/micro/sd15,
written with `models micro`, exported by optimum too) at 64², 20 steps, CFG 5, on `--count` prompts of
synthetic_world.prompt_grid() (seed 0): every route's images against the fp32 uncached pipeline (diffusers fp32
eager, fed the project's seeded noise as `latents`, so every route starts from the same noise), PSNR/SSIM and
prompt_following's share of images that draw their prompt. The step-cache table: DeepCache intervals 2/3/5 on the
fp32 and the int8 UNet against the same reference. `--stage flux-thresholds`: first-block caching thresholds
0.05-0.6 on the FLUX micro-model; refused while trt_diffusion/data/micro/flux does not exist.

The optimum-intel venv (outside the project's dependencies, as a user installs it; `--setup` runs exactly this):

    python3.11 -m venv build/optimum-venv
    build/optimum-venv/bin/pip install torch==2.13.0      # first: the CPU build on disk (PIP_FIND_LINKS)
    echo torch==2.13.0 > build/optimum-venv/constraints.txt
    build/optimum-venv/bin/pip install -c build/optimum-venv/constraints.txt "optimum-intel[openvino,diffusers]"
    build/optimum-venv/bin/pip uninstall -y torchvision

The constraint is needed: optimum-intel requires torchvision unpinned, and the newest torchvision pulls a newer torch
(a multi-GB CUDA build) over the CPU one; with torch held, pip takes torchvision 0.28.0, the one of torch 2.13. That
wheel is PyPI's CUDA build and does not load beside the CPU torch ("operator torchvision::nms does not exist"), and
transformers then fails `from optimum.intel import OVStableDiffusionPipeline` (its AutoProcessor import); without
torchvision transformers falls back to its PIL image processors and the pipeline imports (the text-to-image path
uses no torchvision; `pip check` names the missing requirement). A user with network would take torchvision from
PyTorch's CPU index instead. The `diffusers` extra is what `OVStableDiffusionPipeline` imports; pip chooses its
version.

    .venv/bin/python scripts/bench_cpu_pipeline.py --setup
    .venv/bin/python scripts/bench_cpu_pipeline.py                       # full size, 512², 20 steps, median of 5
    .venv/bin/python scripts/bench_cpu_pipeline.py --size tiny --resolution 64 --steps 2 --repeats 1 --count 2
    .venv/bin/python scripts/bench_cpu_pipeline.py --stage quality --stage step-cache --count 12

Writes <workdir>/bench_cpu_pipeline.json (or --json) and prints markdown tables. Not a test: minutes to an hour of
CPU. Memory: one route at a time, about 8 GB at 512² for the full-size UNet.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent
DEFAULT_VENV = ROOT / "build" / "optimum-venv"
OPTIMUM_PACKAGES = ("optimum-intel", "optimum", "openvino", "openvino-tokenizers", "nncf", "diffusers",
                    "transformers", "huggingface-hub", "tokenizers", "torch", "torchvision", "numpy")
MICRO = {"resolution": 64, "steps": 20, "guidance": 5.0}  # the micro-model's figures are measured at these
DEEPCACHE_INTERVALS = (2, 3, 5)
FLUX_THRESHOLDS = (0.05, 0.08, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)  # 0.08: the published default
RESULT = "RESULT "  # a worker's last stdout line: RESULT {json}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------------------------- the optimum venv


def setup_commands(venv: Path) -> list[list[str]]:
    python = str(venv / "bin" / "python")
    constraints = venv / "constraints.txt"
    return [["python3.11", "-m", "venv", str(venv)],
            [python, "-m", "pip", "install", "torch==2.13.0"],
            [python, "-m", "pip", "install", "-c", str(constraints), "optimum-intel[openvino,diffusers]"],
            [python, "-m", "pip", "uninstall", "-y", "torchvision"]]


def setup_venv(venv: Path) -> dict:
    """Create the optimum-intel venv (the docstring's commands) and return the versions it got."""
    for command in setup_commands(venv):
        if "-c" in command:
            (venv / "constraints.txt").write_text("torch==2.13.0\n")
        log("$ " + " ".join(command))
        subprocess.run(command, check=True)
    return venv_versions(venv)


def venv_versions(venv: Path) -> dict:
    code = ("import importlib.metadata as m, json\n"
            f"names = {list(OPTIMUM_PACKAGES)!r}\n"
            "out = {}\n"
            "for n in names:\n"
            "    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: out[n] = None\n"
            "print(json.dumps(out))")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def venv_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"no optimum-intel venv at {venv}: run `{sys.executable} {__file__} --setup` first "
                         "(or --venv DIR)")
    return python


def rewrite_text_encoder(source: Path, out: Path) -> dict:
    """Run in the optimum venv: the text encoder as this venv's transformers writes it, when it cannot read the
    project's (transformers 5.23 saves CLIPTextModel's weights without the `text_model.` prefix 5.5 expects: 5.5
    loads the folder with every weight UNEXPECTED and MISSING, i.e. a randomly initialised encoder, with no
    error). Same tensors, prefixed; the load must then match every key."""
    from safetensors.torch import load_file
    from transformers import CLIPTextModel

    model, info = CLIPTextModel.from_pretrained(source, output_loading_info=True)
    if not (info["missing_keys"] or info["unexpected_keys"]):
        return {"rewritten": False}
    state: dict = {}
    for file in sorted(source.glob("*.safetensors")):
        state.update(load_file(file))
    result = model.load_state_dict({k if k.startswith("text_model.") else f"text_model.{k}": v
                                    for k, v in state.items()}, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise SystemExit(f"{source}: the text encoder's weights do not map onto this transformers' CLIPTextModel "
                         f"(missing {result.missing_keys[:4]}, unexpected {result.unexpected_keys[:4]})")
    model.save_pretrained(out)
    return {"rewritten": True, "tensors": len(state)}


def optimum_folder(venv: Path, folder: Path, out: Path) -> tuple[Path, dict]:
    """The folder as the optimum venv reads it: its components linked, the text encoder rewritten by the venv's
    transformers where that cannot read the project's (rewrite_text_encoder)."""
    marker = out / "rewrite.json"
    if marker.is_file():
        return out, json.loads(marker.read_text())
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        import shutil

        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    for entry in folder.iterdir():
        (partial / entry.name).symlink_to(entry.resolve())
    (partial / "text_encoder").unlink()
    command = [str(venv_python(venv)), str(Path(__file__).resolve()), "--rewrite-text-encoder",
               str(folder / "text_encoder"), str(partial / "text_encoder")]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"rewriting the text encoder in the optimum venv failed:\n{done.stderr[-3000:]}")
    verdict = json.loads(lines[-1][len(RESULT):])
    if not verdict["rewritten"]:
        (partial / "text_encoder").symlink_to((folder / "text_encoder").resolve())
    (partial / "rewrite.json").write_text(json.dumps(verdict))
    partial.rename(out)
    log(f"{out}: text encoder {'rewritten for' if verdict['rewritten'] else 'read as is by'} the optimum venv")
    return out, verdict


def optimum_export(venv: Path, folder: Path, out: Path) -> Path:
    """optimum's own exporter on a local diffusers folder, fp32 weights (cached when the IR is there); the folder
    first made readable by the venv's transformers (optimum_folder)."""
    if (out / "model_index.json").is_file() and (out / "unet" / "openvino_model.xml").is_file():
        return out
    folder, _ = optimum_folder(venv, folder, out.with_name(out.name + "-source"))
    partial = out.with_name(out.name + ".partial")
    command = [str(venv / "bin" / "optimum-cli"), "export", "openvino", "--model", str(folder), "--task",
               "text-to-image", "--weight-format", "fp32", str(partial)]
    log("$ " + " ".join(command))
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise SystemExit(f"optimum-cli export failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    partial.rename(out)
    log(f"optimum export: {time.perf_counter() - started:.0f} s")
    return out


# ------------------------------------------------------------------------------------------- the CPU


def cpu_description() -> dict:
    """lscpu's model name, whether AMX / AVX512-BF16 are there, the cores this process may use."""
    flags: set[str] = set()
    name = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                name = value.strip()
            elif key.strip() == "Flags":
                flags = set(value.split())
    except (OSError, subprocess.CalledProcessError):
        pass
    amx = sorted(f for f in flags if f.startswith("amx"))
    return {"model_name": name, "amx": amx, "avx512_bf16": "avx512_bf16" in flags,
            "avx512f": "avx512f" in flags, "cores": len(os.sched_getaffinity(0)),
            "bf16_native": bool(amx) or "avx512_bf16" in flags}


def cpu_line(cpu: dict) -> str:
    amx = f"AMX ({', '.join(cpu['amx'])})" if cpu["amx"] else "no AMX"
    bf16 = "AVX512-BF16" if cpu["avx512_bf16"] else "no AVX512-BF16"
    return f"{cpu['model_name']}, {amx}, {bf16}, {cpu['cores']} cores"


# ------------------------------------------------------------------------------------------- routes


def routes(cpu: dict, stage: str) -> list[dict]:
    """Every route of a table: name, kind (diffusers / optimum / project), its settings, or why it cannot run."""
    no_bf16 = None if cpu["bf16_native"] else \
        "this CPU has no AMX-BF16/AVX512-BF16: bf16 is emulated here, not a route anyone would take"
    side = "bf16" if cpu["bf16_native"] else "fp32"  # the int8 UNet's text encoder and VAE
    table = [
        {"name": "diffusers fp32 eager", "kind": "diffusers", "dtype": "fp32"},
        {"name": "diffusers bf16 eager", "kind": "diffusers", "dtype": "bf16", "unavailable": no_bf16},
        {"name": "optimum-intel OVStableDiffusionPipeline", "kind": "optimum"},
        {"name": "project openvino fp32", "kind": "project", "model": "fp32"},
        {"name": "project openvino bf16", "kind": "project", "model": "bf16", "unavailable": no_bf16},
        {"name": f"project openvino int8 UNet ({side} TE/VAE)", "kind": "project", "model": "int8"},
    ]
    intervals = (2, 3) if stage == "speed" else ()
    table += [{"name": f"project openvino int8 UNet + DeepCache N={n}", "kind": "project", "model": "int8",
               "interval": n} for n in intervals]
    if stage == "step-cache":
        table = [{"name": f"project openvino {m} UNet + DeepCache N={n}", "kind": "project", "model": m,
                  "interval": n} for m in ("fp32", "int8") for n in DEEPCACHE_INTERVALS]
    return table


def engines_yaml(work: Path, folder: Path, resolution: int, cpu: dict, fp32_cache: bool) -> Path:
    """The project's routes as engines.yaml models (bench_step_cache.py's sd15 entry, openvino only): fp32, bf16
    (where native) and the int8 UNet with DeepCache pieces. Image gates are opened: on random weights (speed) they
    say nothing, on the micro-model this script reports the images' quality itself."""
    import yaml

    sys.path.insert(0, str(SCRIPTS))
    from bench_step_cache import model_entry

    def entry(precision: dict, cache: bool) -> dict:
        model = model_entry("sd15", resolution, ["openvino"], 0)
        model["source"] = os.path.relpath(folder, work)
        model["precision"] = precision
        if cache:
            model["step_cache"]["gate"] = {"min_psnr_db": 5.0, "min_ssim": 0.1}
        else:
            del model["step_cache"]
        return model

    side = "bf16" if cpu["bf16_native"] else "fp32"
    models = {"fp32": entry(dict.fromkeys(("text_encoder", "unet", "vae_decoder"), "fp32"), fp32_cache),
              "int8": {**entry({"text_encoder": side, "unet": "int8", "vae_decoder": side}, True),
                       "quantization": {"calibration": {"samples": 4, "steps": 4, "seed": 0}},
                       "parity": {"int8": {"min_psnr_db": 5.0, "min_ssim": 0.1}}}}
    if cpu["bf16_native"]:
        models["bf16"] = entry(dict.fromkeys(("text_encoder", "unet", "vae_decoder"), "bf16"), False)
    path = work / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build", "opset": 20},
                                    "defaults": {"cfg": "batched", "batch": [1]}, "models": models},
                                   sort_keys=False))
    return path


def build_project(config: Path) -> float:
    from trt_diffusion import api

    started = time.perf_counter()
    report = api.build(config)
    if report.failed:
        raise SystemExit(f"the project's build failed: {[o.error for o in report.failed]}")
    seconds = time.perf_counter() - started
    log(f"project build (export, quantize, engines; cached when unchanged): {seconds:.0f} s")
    return seconds


# ------------------------------------------------------------------------------------------- workers


def _noise(seed: int, resolution: int):
    """The project's seeded noise (runtime/pipeline.py's _item): diffusers and optimum get it as `latents`."""
    import torch

    generator = torch.Generator().manual_seed(int(seed))
    return torch.randn((1, 4, resolution // 8, resolution // 8), generator=generator, dtype=torch.float32)


def _to_uint8(image) -> np.ndarray:
    """diffusers' output_type="np" float [0, 1] HWC -> uint8 as its numpy_to_pil rounds."""
    return (np.asarray(image, np.float32) * 255).round().astype(np.uint8)


def _diffusers_draw(job: dict):
    import torch
    from diffusers import StableDiffusionPipeline

    dtype = torch.bfloat16 if job["route"]["dtype"] == "bf16" else torch.float32
    pipe = StableDiffusionPipeline.from_pretrained(job["folder"], dtype=dtype, safety_checker=None,
                                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)

    def draw(prompt: str, seed: int, steps: int) -> np.ndarray:
        out = pipe(prompt, height=job["resolution"], width=job["resolution"], num_inference_steps=steps,
                   guidance_scale=job["guidance"], latents=_noise(seed, job["resolution"]).to(dtype),
                   output_type="np")
        return _to_uint8(out.images[0])
    return draw


def _optimum_draw(job: dict):
    import torch
    from optimum.intel import OVStableDiffusionPipeline

    pipe = OVStableDiffusionPipeline.from_pretrained(job["ir"], compile=False)
    pipe.reshape(batch_size=1, height=job["resolution"], width=job["resolution"], num_images_per_prompt=1)
    pipe.compile()
    pipe.set_progress_bar_config(disable=True)

    def draw(prompt: str, seed: int, steps: int) -> np.ndarray:
        with torch.inference_mode():
            out = pipe(prompt, height=job["resolution"], width=job["resolution"], num_inference_steps=steps,
                       guidance_scale=job["guidance"], latents=_noise(seed, job["resolution"]), output_type="np")
        return _to_uint8(out.images[0])
    return draw


def _project_draw(job: dict):
    from dataclasses import replace

    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import engine_runners
    from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest

    config = load_engines_file(Path(job["config"]))
    route, name = job["route"], job["route"]["model"]
    model_dir, family, table = engine_runners(config, name, "openvino")
    cache = config.models[name].step_cache
    interval, threshold = route.get("interval"), route.get("threshold")
    if interval is not None:
        cache = replace(cache, interval=int(interval))
    if threshold is not None:
        cache = replace(cache, threshold=float(threshold))
    pipe = EnginePipeline(model_dir, family, table, step_cache=cache)
    mode = None if cache is None else ("on" if interval is not None or threshold is not None else "off")

    def draw(prompt: str, seed: int, steps: int) -> np.ndarray:
        request = GenerationRequest(prompt=prompt, height=job["resolution"], width=job["resolution"], steps=steps,
                                    guidance_scale=job["guidance"], seed=seed, step_cache=mode)
        return pipe.generate(request).images[0]
    return draw


def worker(job: dict) -> dict:
    """One process, one route: load, a short warm-up image, then the timed image(s)."""
    kind = job["route"]["kind"]
    if kind in ("diffusers", "optimum"):
        import torch

        torch.set_num_threads(len(os.sched_getaffinity(0)))
    started = time.perf_counter()
    draw = {"diffusers": _diffusers_draw, "optimum": _optimum_draw, "project": _project_draw}[kind](job)
    load_s = time.perf_counter() - started
    prompts = job["prompts"]
    started = time.perf_counter()
    if job["warmup_steps"]:
        draw(prompts[0], 0, job["warmup_steps"])
    warmup_s = time.perf_counter() - started
    seconds, images = [], []
    for prompt in prompts:
        for seed in job["seeds"]:
            started = time.perf_counter()
            images.append(draw(prompt, seed, job["steps"]))
            seconds.append(time.perf_counter() - started)
    if job.get("images"):
        np.save(job["images"], np.stack(images))
    return {"load_s": load_s, "warmup_s": warmup_s, "image_s": seconds}


def run_worker(job: dict, python: Path, timeout: float | None = None) -> dict:
    """`job` in a fresh process of `python` (the project's venv, or the optimum venv for optimum)."""
    command = [str(python), str(Path(__file__).resolve()), "--worker", json.dumps(job)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
        raise RuntimeError(f"{job['route']['name']} exited {done.returncode}: " + " | ".join(tail))
    return json.loads(lines[-1][len(RESULT):])


# ------------------------------------------------------------------------------------------- stages


def prepare_speed(args, work: Path, cpu: dict) -> tuple[dict, dict]:
    """The folder at --size, the project's engines, optimum's IR; the jobs' common part and what it cost."""
    sys.path.insert(0, str(SCRIPTS))
    from bench_cpu import full_model

    from trt_diffusion.models.tiny import write_tiny_model

    if args.size == "full":
        folder = full_model(work)  # workdir/sd15-full: the full-size UNet and VAE, random weights
    else:
        folder = work / "sd15-tiny"
        if not (folder / "model_index.json").is_file():
            write_tiny_model(folder, "sd15", size="tiny")
    costs = {"project_build_s": build_project(engines_yaml(work, folder, args.resolution, cpu, fp32_cache=False))}
    started = time.perf_counter()
    ir = optimum_export(args.venv, folder, work / f"optimum-{folder.name}")
    costs["optimum_export_s"] = time.perf_counter() - started
    common = {"folder": str(folder), "ir": str(ir), "config": str(work / "engines.yaml"),
              "resolution": args.resolution, "steps": args.steps, "guidance": args.guidance,
              "warmup_steps": args.warmup_steps, "prompts": ["a photograph of an astronaut riding a horse"],
              "seeds": [0]}
    return common, costs


def measure_speed(args, routes_: list[dict], common: dict) -> list[dict]:
    times: dict[str, list[float]] = {r["name"]: [] for r in routes_}
    loads: dict[str, list[float]] = {r["name"]: [] for r in routes_}
    failed: dict[str, str] = {}
    for repeat in range(args.repeats):
        for route in routes_:
            if route.get("unavailable") or route["name"] in failed:
                continue
            python = venv_python(args.venv) if route["kind"] == "optimum" else Path(sys.executable)
            try:
                result = run_worker({**common, "route": route}, python)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # reported; the other routes still run
                failed[route["name"]] = str(exc)[:600]
                log(f"  {route['name']}: FAILED {failed[route['name']]}")
                continue
            times[route["name"]].append(result["image_s"][0])
            loads[route["name"]].append(result["load_s"])
            log(f"  round {repeat + 1}/{args.repeats} {route['name']}: {result['image_s'][0]:.2f} s "
                f"(load {result['load_s']:.1f} s, warm-up {result['warmup_s']:.1f} s)")
    medians = {name: statistics.median(t) for name, t in times.items() if t}
    optimum = medians.get("optimum-intel OVStableDiffusionPipeline")
    eager = medians.get("diffusers fp32 eager")
    rows = []
    for route in routes_:
        row = {"route": route["name"]}
        if route.get("unavailable") or route["name"] in failed:
            row["unavailable"] = route.get("unavailable") or failed[route["name"]]
        else:
            median = medians[route["name"]]
            row.update(median_s=median, runs_s=times[route["name"]], load_s=statistics.median(loads[route["name"]]),
                       vs_optimum=optimum / median if optimum else None, vs_diffusers_fp32=eager / median if eager
                       else None)
        rows.append(row)
    return rows


def prepare_quality(args, work: Path, cpu: dict) -> dict:
    """The micro-model's folder (models micro), its engines (fp32 with DeepCache pieces too) and optimum's IR."""
    from trt_diffusion import api
    from trt_diffusion import synthetic_world as world

    folder = work / "micro-sd15"
    if not (folder / "model_index.json").is_file():
        api.make_micro_model(folder, "sd15")
    config = engines_yaml(work, folder, MICRO["resolution"], cpu, fp32_cache=True)
    build_project(config)
    ir = optimum_export(args.venv, folder, work / "optimum-micro-sd15")
    grid = world.prompt_grid()
    prompts = grid[:: max(len(grid) // args.count, 1)][: args.count]
    return {"folder": str(folder), "ir": str(ir), "config": str(config), **MICRO, "warmup_steps": 0,
            "prompts": prompts, "seeds": [0]}


def measure_quality(args, routes_: list[dict], common: dict, work: Path, reference: np.ndarray | None
                    ) -> tuple[list[dict], np.ndarray]:
    """Each route's images on the prompts against the reference (diffusers fp32 eager, drawn first when absent)."""
    from trt_diffusion.metrics import psnr, ssim
    from trt_diffusion.prompt_following import grid_figures

    prompts = [p for p in common["prompts"] for _ in common["seeds"]]
    images_dir = work / "images"
    images_dir.mkdir(exist_ok=True)

    def draw(route: dict) -> np.ndarray:
        out = images_dir / (route["name"].replace(" ", "_").replace("/", "-") + ".npy")
        python = venv_python(args.venv) if route["kind"] == "optimum" else Path(sys.executable)
        run_worker({**common, "route": route, "images": str(out)}, python)
        return np.load(out)

    if reference is None:
        log("  reference: diffusers fp32 eager")
        reference = draw({"name": "diffusers fp32 eager", "kind": "diffusers", "dtype": "fp32"})
    rows = []
    for route in routes_:
        row = {"route": route["name"]}
        if route.get("unavailable"):
            rows.append({**row, "unavailable": route["unavailable"]})
            continue
        try:
            images = reference if route["name"] == "diffusers fp32 eager" else draw(route)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            rows.append({**row, "unavailable": str(exc)[:600]})
            log(f"  {route['name']}: FAILED {rows[-1]['unavailable']}")
            continue
        psnrs = [psnr(r, i) for r, i in zip(reference, images, strict=True)]
        row.update(psnr_db_mean=float(np.mean(psnrs)), psnr_db_min=float(np.min(psnrs)),
                   ssim_mean=float(np.mean([ssim(r, i) for r, i in zip(reference, images, strict=True)])),
                   prompt_following=grid_figures(list(images), prompts), images=len(images))
        log(f"  {route['name']}: PSNR {row['psnr_db_mean']:.1f} dB (min {row['psnr_db_min']:.1f}), "
            f"SSIM {row['ssim_mean']:.3f}, following {row['prompt_following']}")
        rows.append(row)
    return rows, reference


def refuse_without_flux() -> None:
    from trt_diffusion.models.micro import DATA

    if not (DATA / "flux" / "model_index.json").is_file():
        raise SystemExit(f"--stage flux-thresholds needs the trained FLUX micro-model ({DATA / 'flux'}), which "
                         "does not exist yet (it is being trained for the micro-model issue): run this stage once "
                         "it is shipped")


def flux_thresholds(args, work: Path) -> list[dict]:
    """First-block caching thresholds on the FLUX micro-model, against its uncached fp32 engines (openvino)."""
    refuse_without_flux()
    import yaml

    from trt_diffusion import api
    from trt_diffusion import synthetic_world as world

    sys.path.insert(0, str(SCRIPTS))
    from bench_step_cache import model_entry

    folder = work / "micro-flux"
    if not (folder / "model_index.json").is_file():
        api.make_micro_model(folder, "flux")
    model = model_entry("flux", MICRO["resolution"], ["openvino"], 0)
    model["source"] = os.path.relpath(folder, work)
    model["step_cache"]["gate"] = {"min_psnr_db": 5.0, "min_ssim": 0.1}
    config = work / "engines-flux.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build", "opset": 20},
                                      "models": {"flux": model}}, sort_keys=False))
    build_project(config)
    grid = world.prompt_grid()
    common = {"config": str(config), **MICRO, "guidance": 3.5, "warmup_steps": 0, "seeds": [0],
              "prompts": grid[:: max(len(grid) // args.count, 1)][: args.count]}
    reference_route = {"name": "project openvino fp32 uncached", "kind": "project", "model": "flux"}
    threshold_routes = [{"name": f"project openvino fp32 first-block t={t}", "kind": "project", "model": "flux",
                         "threshold": t} for t in FLUX_THRESHOLDS]
    images_dir = work / "images"
    images_dir.mkdir(exist_ok=True)
    out = images_dir / "flux_reference.npy"
    run_worker({**common, "route": reference_route, "images": str(out)}, Path(sys.executable))
    reference = np.load(out)
    rows, _ = measure_quality(args, threshold_routes, common, work, reference)
    return rows


# ------------------------------------------------------------------------------------------- tables


def _seconds(value: float) -> str:
    return f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def speed_table(rows: list[dict]) -> str:
    lines = ["| route | median s/image | × vs optimum-intel | × vs diffusers fp32 |", "|---|---|---|---|"]
    for row in rows:
        if "unavailable" in row:
            lines.append(f"| {row['route']} | not run: {row['unavailable']} | | |")
            continue
        ratio = [f"{row[k]:.2f}×" if row.get(k) else "—" for k in ("vs_optimum", "vs_diffusers_fp32")]
        lines.append(f"| {row['route']} | {_seconds(row['median_s'])} | {ratio[0]} | {ratio[1]} |")
    return "\n".join(lines)


def quality_table(rows: list[dict]) -> str:
    lines = ["| route | PSNR dB mean (min) | SSIM mean | prompt following: background / colour / shape / style % |",
             "|---|---|---|---|"]
    for row in rows:
        if "unavailable" in row:
            lines.append(f"| {row['route']} | not run: {row['unavailable']} | | |")
            continue
        shown = "inf" if row["psnr_db_mean"] == float("inf") else f"{row['psnr_db_mean']:.1f}"
        following = row["prompt_following"]
        aspects = " / ".join(f"{following[a]:.0f}" for a in ("background", "colour", "shape", "style")) \
            if following else "n/a"
        lines.append(f"| {row['route']} | {shown} ({row['psnr_db_min']:.1f}) | {row['ssim_mean']:.3f} | {aspects} |")
    return "\n".join(lines)


def combined_table(speed: list[dict], quality: list[dict]) -> str:
    """Speed on the full-size architecture and quality on the trained micro-model, one row per route."""
    by_route = {row["route"]: row for row in quality}  # quality and step-cache rows
    lines = ["| route | median s/image | × vs optimum-intel | × vs diffusers fp32 | PSNR dB (micro) | SSIM | "
             "shape / colour followed % |", "|---|---|---|---|---|---|---|"]
    for row in speed:
        q = by_route.get(row["route"], {})
        speed_cells = ["not run", "", ""] if "unavailable" in row else [
            _seconds(row["median_s"]), *(f"{row[k]:.2f}×" if row.get(k) else "—"
                                        for k in ("vs_optimum", "vs_diffusers_fp32"))]
        if "psnr_db_mean" in q:
            following = q["prompt_following"] or {}
            quality_cells = [f"{q['psnr_db_mean']:.1f}", f"{q['ssim_mean']:.3f}",
                             f"{following.get('shape', float('nan')):.0f} / {following.get('colour', float('nan')):.0f}"]
        else:
            quality_cells = ["—", "—", "—"]
        lines.append(f"| {row['route']} | " + " | ".join(speed_cells + quality_cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="create the optimum-intel venv (--venv), then exit")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--stage", action="append", choices=["speed", "quality", "step-cache", "flux-thresholds"],
                        help="repeatable; default: speed, quality and step-cache")
    parser.add_argument("--size", choices=["full", "tiny"], default="full", help="the speed stage's SD1.5 folder")
    parser.add_argument("--resolution", type=int, default=512, help="the speed stage's pixels per side")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=7.5, help="the speed stage's CFG scale (> 1: batch 2)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="the untimed warm-up image's steps")
    parser.add_argument("--repeats", type=int, default=5, help="processes per route (the median is reported)")
    parser.add_argument("--count", type=int, default=12, help="prompts of the quality stages")
    parser.add_argument("--workdir", type=Path, default=ROOT / "build" / "bench-cpu-pipeline")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rewrite-text-encoder", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rewrite_text_encoder:
        print(RESULT + json.dumps(rewrite_text_encoder(*map(Path, args.rewrite_text_encoder))), flush=True)
        return 0
    if args.worker:
        print(RESULT + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    if args.setup:
        print(json.dumps(setup_venv(args.venv), indent=2))
        return 0
    stages = args.stage or ["speed", "quality", "step-cache"]
    if "flux-thresholds" in stages:
        refuse_without_flux()  # before any minute is spent on the other stages
    cpu = cpu_description()
    log(f"CPU: {cpu_line(cpu)}; load {os.getloadavg()}")
    report: dict = {"cpu": cpu, "optimum_venv": venv_versions(args.venv) if venv_python(args.venv) else None,
                    "load_average_start": os.getloadavg(), "python": platform.python_version(),
                    "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                 if k not in ("worker", "setup", "rewrite_text_encoder")}}
    log(f"optimum venv: {report['optimum_venv']}")
    started = time.perf_counter()
    if "speed" in stages:
        work = args.workdir / f"speed-{args.size}-{args.resolution}"
        work.mkdir(parents=True, exist_ok=True)
        common, costs = prepare_speed(args, work, cpu)
        log(f"speed: {args.size} SD1.5, {args.resolution}², {args.steps} steps, CFG {args.guidance}, "
            f"median of {args.repeats}")
        rows = measure_speed(args, routes(cpu, "speed"), common)
        report["speed"] = {"size": args.size, "resolution": args.resolution, "steps": args.steps, **costs,
                           "rows": rows}
        print(f"\nwhole pipeline, {args.size} SD1.5, {args.resolution}², {args.steps} steps, CFG {args.guidance}, "
              f"median of {args.repeats} ({cpu_line(cpu)})\n\n{speed_table(rows)}\n", flush=True)
    reference = None
    if "quality" in stages or "step-cache" in stages:
        work = args.workdir / "micro"
        work.mkdir(parents=True, exist_ok=True)
        common = prepare_quality(args, work, cpu)
        for stage in ("quality", "step-cache"):
            if stage not in stages:
                continue
            log(f"{stage}: micro SD1.5, 64², 20 steps, CFG 5, {len(common['prompts'])} prompts")
            rows, reference = measure_quality(args, routes(cpu, stage), common, work, reference)
            report[stage.replace("-", "_")] = {"prompts": common["prompts"], "rows": rows}
            print(f"\n{stage}: the trained SD1.5 micro-model, 64², 20 steps, CFG 5, {len(rows and common['prompts'])} "
                  f"prompts, vs diffusers fp32 eager\n\n{quality_table(rows)}\n", flush=True)
    if "speed" in report and "quality" in report:
        quality_rows = report["quality"]["rows"] + report.get("step_cache", {}).get("rows", [])
        print(f"\nspeed ({args.size} SD1.5, {args.resolution}²) and quality (micro-model)\n\n"
              f"{combined_table(report['speed']['rows'], quality_rows)}\n", flush=True)
    if "flux-thresholds" in stages:
        work = args.workdir / "micro-flux"
        work.mkdir(parents=True, exist_ok=True)
        rows = flux_thresholds(args, work)
        report["flux_thresholds"] = {"rows": rows}
        print(f"\nfirst-block thresholds, FLUX micro-model\n\n{quality_table(rows)}\n", flush=True)
    report["seconds"] = time.perf_counter() - started
    report["load_average_end"] = os.getloadavg()
    out = args.json or args.workdir / "bench_cpu_pipeline.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    log(f"done in {report['seconds']:.0f} s; figures in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
