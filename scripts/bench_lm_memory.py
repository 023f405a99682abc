"""Memory of exporting and quantizing the 2026 DiT families' language-model encoders and transformers (issue #26).

On a mid-size config (hundreds of MB of fp32 weights: at the tiny size torch's own footprint dominates and says
nothing), each step in its own process: `api.export` of the text encoder and of the transformer, `api.quantize` of the text
encoder (int8: ModelOpt calibration on the runtime's tokens, the legacy trace, the gate on its hidden states) and of
the transformer (int8: calibration on the pipeline's generations, the legacy trace, the gate). Reported per step: the whole process tree's peak RSS above the process's own baseline (after importing torch,
diffusers, transformers, onnx, onnxscript, onnxruntime and, to quantize, ModelOpt: about 0.45 GB of code and tables
that every step carries whatever the model), per stage and overall, and that over the component's fp32 weights as
the engine holds them (the encoders' decoder stack, not the folder's vision tower or LM head).

The mid-size folder is the tiny seeded folder of the family with its encoder widened (FLUX.2 dev / Klein: 1024 wide,
MLP 2048, their 30 / 27 layers: about 1.1 / 1.0 GB of fp32 weights; Qwen-Image: 1024 × 8 layers, MLP 2816, vocab 32,000: about
0.5 GB) and its transformer widened
to the encoder's states (FLUX.2: 16 heads × 64, 4 double and 8 single blocks, about 0.9 GB).

Usage: `python scripts/bench_lm_memory.py --family flux2 [--only export|quantize] [--component text_encoder|transformer]
[--workdir build/bench-lm] [--json out.json]`
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

from tree_memory import GIB, RssSampler, marks_from_progress, run_step

SIZE = 256  # the transformer's bucket: 256x256 pixels (256 image tokens)
LAZY_IMPORTS = ("transformers.modeling_utils", "diffusers.models.modeling_utils", "torch.export",
                "torch._functorch.partitioners", "onnx_graphsurgeon", "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                "transformers.models.mistral3.modeling_mistral3", "transformers.models.qwen3.modeling_qwen3")


def build_mid_folder(family: str, out: Path) -> None:
    """The tiny folder of `family`, its encoder and transformer widened (seeded), written once."""
    import torch

    from trt_diffusion.models import tiny_flux2, tiny_qwen
    from trt_diffusion.models.tiny import build_tiny_pipeline

    if (out / "model_index.json").is_file():
        return
    pipe = build_tiny_pipeline(family)
    torch.manual_seed(1)
    if family in ("flux2", "flux2_klein"):
        klein = family == "flux2_klein"
        hidden = 1024
        encoder = (tiny_flux2.qwen3_text_encoder if klein else tiny_flux2.mistral_text_encoder)(
            pipe.tokenizer, hidden=hidden, intermediate=2048)
        config = dict(tiny_flux2.TINY_TRANSFORMER, num_layers=4, num_single_layers=8, attention_head_dim=64,
                      num_attention_heads=16, joint_attention_dim=3 * hidden, timestep_guidance_channels=256,
                      mlp_ratio=3.0, axes_dims_rope=(16, 16, 16, 16))
        from diffusers import Flux2Transformer2DModel

        pipe.text_encoder, pipe.transformer = encoder, Flux2Transformer2DModel(**config, guidance_embeds=not klein)
    else:
        hidden = 1024
        encoder = tiny_qwen.qwen_text_encoder(hidden, vocab_size=32000, tokenizer=pipe.tokenizer, layers=8,
                                              intermediate=2816)
        from diffusers import QwenImageTransformer2DModel

        pipe.text_encoder = encoder
        pipe.transformer = QwenImageTransformer2DModel(**dict(tiny_qwen.TINY_TRANSFORMER, num_layers=4,
                                                              attention_head_dim=64, num_attention_heads=8,
                                                              joint_attention_dim=hidden, axes_dims_rope=(16, 24, 24)))
    pipe.save_pretrained(out, safe_serialization=True)


def write_engines_yaml(workdir: Path, model_dir: Path, family: str, precision: str,
                      quantized: str = "transformer") -> Path:
    """engines.yaml of the mid folder: `quantized` (the transformer or the text encoder) at `precision`, the rest fp32."""
    path = workdir / f"engines-{quantized}-{precision}.yaml"
    chosen = {"text_encoder": "fp32", "transformer": "fp32", "vae_decoder": "fp32", quantized: precision}
    cfg = "none" if family == "flux2" else "split"
    path.write_text(
        "version: 1\n"
        "build: {workspace: build}\n"
        "models:\n"
        "  mid:\n"
        f"    source: {model_dir}\n"
        f"    family: {family}\n"
        "    components: [text_encoder, transformer, vae_decoder]\n"
        f"    buckets: ['{SIZE}x{SIZE}']\n"
        "    batch: [1]\n"
        f"    cfg: [{cfg}]\n"
        "    targets: [onnxruntime]\n"
        f"    precision: {{{', '.join(f'{k}: {v}' for k, v in chosen.items())}}}\n"
        "    quantization: {calibration: {samples: 2, steps: 2, seed: 0}}\n"
    )
    return path


def engine_weight_bytes(model_dir: Path, family: str, component: str) -> int:
    """fp32 bytes of what the engine holds (the plan's count of its parameters, times 4)."""
    from trt_diffusion import api

    plan = api.plan(write_engines_yaml(model_dir.parent, model_dir, family, "fp32"))
    row = next(r for r in plan.rows if r.component == component)
    return 4 * row.parameters


def step(config: Path, stage: str, component: str) -> dict:
    """One measured step in this (fresh) process: its peak above the baseline taken before it starts, once the
    libraries the step runs are imported (their code and tables are the process's footprint, not the step's)."""
    import diffusers.pipelines  # noqa: F401
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401
    import onnxscript  # noqa: F401
    import torch.onnx  # noqa: F401
    import transformers  # noqa: F401

    from trt_diffusion import api

    # What the step imports lazily as it runs, whatever the model's size: 1,316 modules, 0.10 GB of code and tables
    # measured on the Qwen-Image encoder's export (transformers' model loading pulls scipy.stats and accelerate,
    # accelerate boto3; torch.export's partitioner networkx; the graph passes onnx-graphsurgeon).
    for name in LAZY_IMPORTS:
        importlib.import_module(name)

    if stage == "quantize":
        import modelopt.torch.quantization  # noqa: F401

    with RssSampler() as sampler:
        sampler.mark("baseline")
        time.sleep(0.3)
        baseline = sampler.peak()
        started = time.perf_counter()
        if stage == "export":  # the export's own stages: reference, exporting, cleaning, parity
            api.export(config, component=component, progress=lambda event: sampler.mark(event.stage))
        else:
            with marks_from_progress(sampler):  # the quantize stage's numbered steps
                api.quantize(config)
        seconds = time.perf_counter() - started
    stages = {name: round((sampler.peaks[name][0] - baseline) / GIB, 3) for name in sampler.stages()
              if name != "baseline" and name in sampler.peaks}
    return {"stage": stage, "component": component, "seconds": round(seconds, 1),
            "baseline_gb": round(baseline / GIB, 3), "peak_gb": round(sampler.peak() / GIB, 3),
            "above_baseline_bytes": sampler.peak() - baseline, "stage_peaks_above_baseline_gb": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["flux2", "flux2_klein", "qwen_image"], default="flux2")
    parser.add_argument("--workdir", type=Path, default=Path("build/bench-lm"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", choices=["export", "quantize"], help="run only that stage's steps")
    parser.add_argument("--component", choices=["text_encoder", "transformer"], help="run only that component's steps")
    parser.add_argument("--step", nargs=3, metavar=("CONFIG", "STAGE", "COMPONENT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        print(json.dumps(step(Path(args.step[0]), args.step[1], args.step[2])))
        return
    workdir = args.workdir.resolve() / args.family
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / "model"
    build_mid_folder(args.family, model_dir)
    results = []
    for stage, component, precision in (("export", "text_encoder", "fp32"), ("export", "transformer", "fp32"),
                                        ("quantize", "text_encoder", "int8"), ("quantize", "transformer", "int8")):
        if args.only and stage != args.only or args.component and component != args.component:
            continue
        config = write_engines_yaml(workdir, model_dir, args.family, precision, component)
        result = run_step(__file__, ["--step", str(config), stage, component], live_stderr=True)
        weights = engine_weight_bytes(model_dir, args.family, component)
        result.update(fp32_weights_gb=round(weights / GIB, 3),
                      ratio=round(result["above_baseline_bytes"] / weights, 2))
        results.append(result)
        print(f"{args.family} {stage} {component}: peak {result['above_baseline_bytes'] / GIB:.2f} GB above the "
              f"baseline = {result['ratio']}x the engine's {weights / GIB:.2f} GB of fp32 weights "
              f"({result['seconds']} s); by stage: {result['stage_peaks_above_baseline_gb']}", file=sys.stderr)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    out = {"family": args.family, "cpu": cpu, "cores": os.cpu_count(), "steps": results}
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
