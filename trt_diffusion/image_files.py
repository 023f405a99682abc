"""Generated images as files: PNGs that carry the request that made them, and names that never overwrite.

The text chunk `parameters` is the form AUTOMATIC1111's web UI writes and reads (and ComfyUI, InvokeAI and
most image viewers show):

    a lighthouse at dusk
    Negative prompt: blurry
    Steps: 20, Sampler: ddim, CFG scale: 7.5, Seed: 0, Size: 512x512, Model: sd15-tiny

beside it, `trt_diffusion` holds the same request as JSON, exactly (`generate --from PNG` reads it first). An
image-conditioned request adds `Workflow: img2img, Denoising strength: 0.8` (A1111's name for it) to the settings
line; the JSON also names its input files (`init_image`, `mask`: as given on the command line).

Input images (`generate --image`, `--mask`) are read here too: RGB and grayscale uint8 arrays, never resized.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .errors import ConfigError

A1111_KEY = "parameters"
JSON_KEY = "trt_diffusion"
# Text chunks larger than this are not ours (a PNG's text is read into memory whole).
MAX_TEXT_BYTES = 1 << 20
# What a request's fields may hold, as the wire carries them (generate --from): sizes and steps INT32, SEED INT64
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class ImageParameters:
    """What a request asked for; enough to ask again for the same image."""

    prompt: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    negative_prompt: str | None = None
    scheduler: str | None = None
    model: str | None = None
    controlnet: str | None = None
    controlnet_scale: float | None = None
    workflow: str | None = None  # img2img | inpaint | edit (None: txt2img, as before workflows existed)
    strength: float | None = None  # img2img / inpaint: the strength the image was made with
    init_image: str | None = None  # the input files' names, as given (--image, --mask)
    mask: str | None = None

    def a1111_text(self) -> str:
        lines = [self.prompt]
        if self.negative_prompt:
            lines.append(f"Negative prompt: {self.negative_prompt}")
        settings = [f"Steps: {self.steps}", f"Sampler: {self.scheduler or 'default'}",
                    f"CFG scale: {self.guidance_scale:g}", f"Seed: {self.seed}", f"Size: {self.width}x{self.height}"]
        if self.model:
            settings.append(f"Model: {self.model}")
        if self.controlnet:
            settings.append(f"ControlNet: {self.controlnet}"
                            + (f" {self.controlnet_scale:g}" if self.controlnet_scale is not None else ""))
        if self.workflow:
            settings.append(f"Workflow: {self.workflow}")
        if self.strength is not None:
            settings.append(f"Denoising strength: {self.strength:g}")
        lines.append(", ".join(settings))
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def save_png(image, path: str | Path, parameters: ImageParameters | None = None) -> Path:
    """Write a uint8 [H, W, 3] image as PNG with its request in text chunks; atomically (temp name, rename)."""
    import io

    from PIL import Image, PngImagePlugin

    from .workspace.files import atomic_write_bytes

    info = PngImagePlugin.PngInfo()
    if parameters is not None:
        info.add_text(A1111_KEY, parameters.a1111_text())
        info.add_text(JSON_KEY, parameters.to_json())
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", pnginfo=info)
    atomic_write_bytes(path, buffer.getbuffer())
    return Path(path)


def read_png_parameters(path: str | Path) -> ImageParameters:
    """The request a PNG was made from: our JSON chunk, else an A1111 `parameters` text."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    try:
        with Image.open(path) as image:
            if image.format != "PNG":
                raise ConfigError(f"{path}: not a PNG ({image.format}); --from reads the PNGs generate writes")
            text = {k: v for k, v in getattr(image, "text", {}).items() if isinstance(v, str)}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise ConfigError(f"{path}: not a readable image ({exc})") from None
    if len(text.get(JSON_KEY, "")) <= MAX_TEXT_BYTES and JSON_KEY in text:
        return _from_json(path, text[JSON_KEY])
    if A1111_KEY in text and len(text[A1111_KEY]) <= MAX_TEXT_BYTES:
        return parse_a1111(text[A1111_KEY], where=str(path))
    raise ConfigError(f"{path}: no generation parameters in this PNG (neither a '{JSON_KEY}' nor a "
                      f"'{A1111_KEY}' text chunk)")


def _from_json(path: Path, text: str) -> ImageParameters:
    try:
        data = json.loads(text)
        known = {f.name for f in fields(ImageParameters)}
        if not isinstance(data, dict):
            raise TypeError("not an object")
        parameters = ImageParameters(**{k: v for k, v in data.items() if k in known})
    except (ValueError, TypeError, RecursionError) as exc:
        raise ConfigError(f"{path}: the '{JSON_KEY}' text chunk is not a request ({exc})") from None
    return check_parameters(parameters, f"{path}: the '{JSON_KEY}' text chunk")


# field -> (kind, low, high): what generate's options take, the PNG's chunk is held to (int: not a bool)
_FIELD_RULES = {
    "prompt": ("text", None, None), "negative_prompt": ("text?", None, None), "scheduler": ("text?", None, None),
    "model": ("text?", None, None), "controlnet": ("text?", None, None), "workflow": ("text?", None, None),
    "init_image": ("text?", None, None), "mask": ("text?", None, None),
    "width": ("int", 0, MAX_INT32), "height": ("int", 0, MAX_INT32),  # 0: not recorded (the server's first size)
    "steps": ("int", 1, MAX_INT32), "seed": ("int", 0, MAX_SEED),
    "guidance_scale": ("number", None, None), "controlnet_scale": ("number?", None, None),
    "strength": ("number?", None, None),
}


def check_parameters(parameters: ImageParameters, where: str) -> ImageParameters:
    """Each field the type and range generate's own option takes; one ConfigError naming the first that is not
    (a crafted PNG's request is data: nothing in it may crash the command or go out as another type)."""
    import math

    for name, (kind, low, high) in _FIELD_RULES.items():
        value = getattr(parameters, name)
        shown = json.dumps(value)[:60] if not isinstance(value, float) else repr(value)
        if kind.endswith("?"):
            if value is None:
                continue
            kind = kind[:-1]
        if kind == "text" and not isinstance(value, str):
            raise ConfigError(f"{where}: {name} must be text, got {shown}")
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{where}: {name} must be an integer, got {shown}")
            if not low <= value <= high:
                raise ConfigError(f"{where}: {name} must be in [{low}, {high}], got {shown}")
        if kind == "number" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                 or not math.isfinite(value)):
            raise ConfigError(f"{where}: {name} must be a finite number, got {shown}")
    return parameters


_SETTING = re.compile(r"\s*([A-Za-z][A-Za-z0-9 _-]*):\s*([^,]*)")


def parse_a1111(text: str, where: str = "parameters") -> ImageParameters:
    """An A1111 `parameters` text: prompt lines, an optional `Negative prompt:` line, and the settings line."""
    lines = text.strip().splitlines()
    if not lines:
        raise ConfigError(f"{where}: empty parameters text")
    settings_line = lines[-1] if lines[-1].lstrip().startswith("Steps:") else ""
    body = lines[:-1] if settings_line else lines
    negative = None
    for i, line in enumerate(body):
        if line.startswith("Negative prompt:"):
            negative = "\n".join([line.removeprefix("Negative prompt:").strip(), *body[i + 1:]])
            body = body[:i]
            break
    settings = {key.strip(): value.strip() for key, value in _SETTING.findall(settings_line)}
    parameters = _a1111_parameters(body, negative, settings, settings_line, where)
    return check_parameters(parameters, f"{where}: the '{A1111_KEY}' text")


def _a1111_parameters(body: list[str], negative: str | None, settings: dict, settings_line: str,
                      where: str) -> ImageParameters:
    try:
        width, height = (int(v) for v in settings.get("Size", "0x0").split("x"))
        sampler = settings.get("Sampler")
        strength = settings.get("Denoising strength")
        return ImageParameters(
            prompt="\n".join(body), width=width, height=height, steps=int(settings.get("Steps", 20)),
            guidance_scale=float(settings.get("CFG scale", 7.5)), seed=int(settings.get("Seed", 0)),
            negative_prompt=negative or None, scheduler=None if sampler in (None, "default") else sampler.lower(),
            model=settings.get("Model"), workflow=settings.get("Workflow") or None,
            strength=float(strength) if strength else None)
    except ValueError as exc:
        raise ConfigError(f"{where}: unreadable settings line {settings_line!r} ({exc})") from None


def read_input_image(path: str | Path, option: str = "--image"):
    """uint8 [H, W, 3] (RGB; an alpha channel is dropped) of an image file, at its own size."""
    return _read_image(path, option, "RGB")


def read_mask(path: str | Path, option: str = "--mask"):
    """uint8 [H, W] of a mask file, converted to grayscale (white = repaint; diffusers binarises at 0.5)."""
    return _read_image(path, option, "L")


def _read_image(path: str | Path, option: str, mode: str):
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert(mode), dtype=np.uint8)
    except FileNotFoundError:
        raise ConfigError(f"{option} {path}: no such file") from None
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ConfigError(f"{option} {path}: not a readable image ({exc})") from None


def output_paths(output: str | Path, count: int, *, overwrite: bool = False) -> list[Path]:
    """Where `count` images go. One image: `output` itself; several: OUTPUT-0.png, OUTPUT-1.png, …. Unless
    `overwrite`, names already taken are never reused: the images get the next free OUTPUT-0001.png,
    OUTPUT-0002.png, … instead."""
    output = Path(output)
    wanted = [output] if count == 1 else [output.with_name(f"{output.stem}-{i}{output.suffix}") for i in range(count)]
    if overwrite or not any(path.exists() for path in wanted):
        return wanted
    paths, number = [], 1
    while len(paths) < count:
        candidate = output.with_name(f"{output.stem}-{number:04d}{output.suffix}")
        if not candidate.exists():
            paths.append(candidate)
        number += 1
    return paths
