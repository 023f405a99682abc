"""`models tiny` and `models micro`: seeded reference pipeline folders (the tests' models) and the trained
micro-models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..families import Family
from .console import console


def models_tiny(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="folder to write (default models/tiny-FAMILY)")]
    = None,
    family: Annotated[Family, typer.Option("--family")] = next(iter(Family)),  # the first declared: sd15
    size: Annotated[str, typer.Option(
        "--size", help="tiny, or full (real denoiser architecture, random weights; sd15, sdxl, wan, flux2_klein; "
                       "qwen_image's 20B and flux2's 32B transformers: refused where their fp32 weights do not fit)")]
    = "tiny",
    variant: Annotated[str | None, typer.Option(
        "--variant", help="a checkpoint variant: inpaint (sd15, sdxl), fill or kontext (flux), "
                          "two_expert (wan: Wan 2.2's high- and low-noise transformers), i2v (wan: "
                          "Wan 2.1 image-to-video, CLIP image encoder), i2v_two_expert (wan: Wan 2.2 I2V A14B), "
                          "edit (qwen_image: Qwen-Image-Edit)")] = None,
    seed: int = 0,
    controlnet: Annotated[bool, typer.Option("--controlnet", help="also write a ControlNet in <out>/controlnet")] = False,
    lora: Annotated[bool, typer.Option("--lora", help="also write a LoRA in <out>/lora")] = False,
    overwrite: bool = False,
    if_missing: Annotated[bool, typer.Option("--if-missing", help="do nothing when <out> already exists")] = False,
):
    """Write a seeded reference pipeline folder that diffusers' DiffusionPipeline.from_pretrained loads."""
    from .. import api

    out = out or Path("models") / f"tiny-{family.value}"
    if if_missing and (out / "model_index.json").is_file():
        console.print(f"{out} exists; left as it is")
        return
    path = api.make_tiny_model(out, family.value, seed=seed, size=size, controlnet=controlnet, lora=lora,
                               overwrite=overwrite, variant=variant)
    console.print(f"wrote {family.value} ({size}{', ' + variant if variant else ''}) model to {path}")


def models_micro(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="folder to write (default models/micro-FAMILY)")]
    = None,
    family: Annotated[str, typer.Option("--family", help="a family with a micro-model: sd15, flux (its weights "
                                                    "once trained: scripts/train_micro.py --family flux)")] = "sd15",
    overwrite: bool = False,
    if_missing: Annotated[bool, typer.Option("--if-missing", help="do nothing when <out> already exists")] = False,
):
    """Write a trained micro-model (it draws the synthetic world's prompts: "a red circle on a blue background")
    as a diffusers folder, its shipped fp16 weights upcast to fp32."""
    from .. import api

    out = out or Path("models") / f"micro-{family}"
    if if_missing and (out / "model_index.json").is_file():
        console.print(f"{out} exists; left as it is")
        return
    path = api.make_micro_model(out, family, overwrite=overwrite)
    console.print(f"wrote the {family} micro-model to {path}")


COMMANDS = {"tiny": models_tiny, "micro": models_micro}
