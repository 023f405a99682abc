"""LoRA on the onnxruntime target: refit (session with replaced initializers) vs rebuild (re-export + session).

    .venv/bin/python scripts/bench_refit.py --size tiny
    .venv/bin/python scripts/bench_refit.py --size full      # real SD1.5 UNet architecture (860M), ~4 min, ~10 GB

Rebuild = `torch.onnx.export(dynamo=True, optimize=False)` of the UNet + ONNX Runtime session creation.
The export is timed on the base weights: the LoRA-fused model has the same graph and size, so it costs
the same. Refit = `lora_deltas` + `apply_refit_onnxruntime` (one session creation). The refitted session
is checked against PyTorch with the LoRA fused. Figures come from one run; prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trt_diffusion.lora import apply_refit_onnxruntime, build_refit_map, lora_deltas, restore_base  # noqa: E402
from trt_diffusion.models.tiny import build_tiny_lora, build_tiny_pipeline  # noqa: E402

INPUT_NAMES = ["sample", "timestep", "encoder_hidden_states"]


class UNetForExport(torch.nn.Module):
    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.model = unet

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.model(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]


def _inputs(unet: torch.nn.Module, latent: int) -> dict[str, np.ndarray]:
    gen = np.random.default_rng(0)
    return {
        "sample": gen.standard_normal((2, unet.config.in_channels, latent, latent)).astype(np.float32),
        "timestep": np.array([500.0, 500.0], dtype=np.float32),
        "encoder_hidden_states": gen.standard_normal((2, 77, unet.config.cross_attention_dim)).astype(np.float32),
    }


def _timed(label: str, timings: dict, fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    timings[label] = round(time.perf_counter() - start, 3)
    print(f"  {label}: {timings[label]} s", file=sys.stderr, flush=True)
    return result


def _export(unet: torch.nn.Module, inputs: dict[str, np.ndarray], path: Path) -> None:
    args = tuple(torch.from_numpy(inputs[name]) for name in INPUT_NAMES)
    with torch.no_grad():
        program = torch.onnx.export(UNetForExport(unet).eval(), args, dynamo=True, optimize=False,
                                    input_names=INPUT_NAMES, output_names=["noise_pred"], verbose=False)
        program.save(str(path), external_data=True)


def _torch_fused_output(unet: torch.nn.Module, weights: dict, inputs: dict[str, np.ndarray]) -> np.ndarray:
    args = tuple(torch.from_numpy(inputs[name]) for name in INPUT_NAMES)
    with torch.no_grad():
        return torch.func.functional_call(UNetForExport(unet).eval(), {f"model.{k}": v for k, v in weights.items()},
                                          args).numpy()


def bench(size: str, workdir: Path, latent: int) -> dict:
    timings: dict[str, float] = {}
    pipe = _timed("build_model_s", timings, build_tiny_pipeline, "sd15", size=size)
    lora_state = build_tiny_lora(pipe, seed=0)
    lora_dir = workdir / "lora"
    type(pipe).save_lora_weights(lora_dir, unet_lora_layers=lora_state, safe_serialization=True)
    lora_file = lora_dir / "pytorch_lora_weights.safetensors"
    unet = pipe.unet.eval()
    unet.unload_lora()  # build_tiny_lora leaves PEFT wrappers (`to_q.base_layer.weight`) behind
    del pipe, lora_state
    gc.collect()
    parameters = sum(p.numel() for p in unet.parameters())
    inputs = _inputs(unet, latent)

    onnx_path = workdir / "unet.onnx"
    _timed("export_s", timings, _export, unet, inputs, onnx_path)
    refit_map = _timed("refit_map_s", timings, build_refit_map, onnx_path, unet)

    # the refit goes first, so it (not the rebuild) pays for the process's first, slower session creation
    weights = _timed("lora_deltas_s", timings, lora_deltas, unet, [(lora_file, 1.0)])
    refitted = _timed("refit_session_s", timings, apply_refit_onnxruntime, onnx_path, refit_map, weights)
    refit_out = refitted.run(None, inputs)[0]
    del refitted
    gc.collect()
    base = _timed("session_s", timings, restore_base, onnx_path)
    base_out = base.run(None, inputs)[0]
    del base
    gc.collect()
    # a second refit from the base weights gives the same output bit for bit
    second = apply_refit_onnxruntime(onnx_path, refit_map, weights).run(None, inputs)[0]
    expected = _torch_fused_output(unet, weights, inputs)

    refit_s = timings["lora_deltas_s"] + timings["refit_session_s"]
    rebuild_s = timings["export_s"] + timings["session_s"]
    changed_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    return {
        "size": size,
        "parameters": parameters,
        "latents": f"2x{unet.config.in_channels}x{latent}x{latent}",
        "lora_weights_changed": len(weights),
        "lora_changed_bytes": changed_bytes,
        "timings_s": timings,
        "refit_s": round(refit_s, 3),
        "rebuild_s": round(rebuild_s, 3),
        "rebuild_over_refit": round(rebuild_s / refit_s, 1),
        "refit_vs_torch_fused_max_abs": float(np.abs(refit_out - expected).max()),
        "lora_effect_max_abs": float(np.abs(expected - base_out).max()),
        "refit_twice_bit_exact": bool(np.array_equal(refit_out, second)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--latent", type=int, default=None, help="latent side (default 8 tiny, 32 full = 256 px)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the ONNX goes (default: a temp folder)")
    args = parser.parse_args()
    latent = args.latent or (32 if args.size == "full" else 8)
    torch.set_grad_enabled(False)
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = bench(args.size, args.workdir, latent)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-refit-") as tmp:
            result = bench(args.size, Path(tmp), latent)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
