"""The quality baseline: a fixed prompt x seed set of images from a release you trust, tied to the engine keys
it was made with. `--save-baseline` writes it under the workspace (a temporary folder renamed into place);
comparing against a baseline of other engines, or of another prompt set, is a clear error."""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from .errors import PreflightError

BASELINE_FILE = "baseline.json"
BASELINE_SCHEMA_VERSION = 1


def default_folder(config, model: str) -> Path:
    return Path(config.workspace) / "preflight" / "baseline" / model


def folder_for(config, model: str, settings) -> Path:
    if settings.quality.baseline:
        return (Path(config.root) / settings.quality.baseline).resolve()
    return default_folder(config, model)


@dataclass
class Baseline:
    folder: Path
    model: str
    target: str
    engine_keys: list[str]
    size: str
    steps: int
    guidance_scale: float
    images: dict[tuple[str, str, int], np.ndarray]  # (workflow, prompt, seed) -> uint8 image
    created_at: str = ""

    def describe(self) -> dict:
        return {"folder": str(self.folder), "created_at": self.created_at, "engine_keys": len(self.engine_keys),
                "images": len(self.images)}


def _png_name(index: int) -> str:
    return f"image_{index:03d}.png"


def load_baseline(folder: Path, *, model: str, engine_keys: list[str], quality, size: str,
                  config_path, workflows=("txt2img",)) -> Baseline:
    from PIL import Image

    path = folder / BASELINE_FILE
    save_hint = f"trt-diffusion preflight {config_path} --save-baseline"
    if not path.is_file():
        raise PreflightError(f"no quality baseline at {folder}: save one from a release you trust with "
                             f"`{save_hint}` (or leave the check out with --skip quality)")
    try:
        raw = json.loads(path.read_text())
        if raw.get("schema_version") != BASELINE_SCHEMA_VERSION:
            raise ValueError(f"schema_version {raw.get('schema_version')!r}")
        images = {}
        for row in raw["images"]:
            with Image.open(folder / row["png"]) as image:
                # baselines saved before workflows hold txt2img images only
                key = (row.get("workflow", "txt2img"), row["prompt"], int(row["seed"]))
                pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
                if row.get("frames"):  # a clip, saved as its frames one under another (lossless)
                    pixels = pixels.reshape(int(row["frames"]), -1, *pixels.shape[1:])
                images[key] = pixels
        baseline = Baseline(folder, raw["model"], raw["target"], list(raw["engine_keys"]), raw["size"],
                            int(raw["steps"]), float(raw["guidance_scale"]), images, raw.get("created_at", ""))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise PreflightError(f"the quality baseline at {folder} is unreadable ({err}); save it again with "
                             f"`{save_hint}`") from None
    if baseline.model != model:
        raise PreflightError(f"the quality baseline at {folder} is of model {baseline.model!r}, not {model!r}")
    if sorted(baseline.engine_keys) != sorted(engine_keys):
        gone = sorted(set(baseline.engine_keys) - set(engine_keys))
        new = sorted(set(engine_keys) - set(baseline.engine_keys))
        raise PreflightError(f"the quality baseline at {folder} was saved from other engines ({len(gone)} of its "
                             f"engines are not these, {len(new)} of these are new: e.g. {(new or gone)[:2]}); "
                             f"compare like with like, or save a new baseline with `{save_hint}`")
    wanted = {(str(w), p, s) for w in workflows for p in quality.prompts for s in quality.seeds}
    if set(baseline.images) != wanted or baseline.steps != quality.steps or baseline.size != size \
            or baseline.guidance_scale != quality.guidance_scale:
        raise PreflightError(f"the quality baseline at {folder} has another prompt x seed set ({len(baseline.images)} "
                             f"images, {baseline.steps} steps at {baseline.size}) than preflight.quality asks for "
                             f"({len(wanted)} images, {quality.steps} steps at {size}); save it again with "
                             f"`{save_hint}`")
    return baseline


def save_baseline(baseline: Baseline) -> Path:
    """Write the baseline to a temporary folder beside its place, then swap it in: never half a baseline."""
    from PIL import Image

    folder = baseline.folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        rows = []
        for index, ((workflow, prompt, seed), pixels) in enumerate(baseline.images.items()):
            buffer = io.BytesIO()
            pixels = np.asarray(pixels, dtype=np.uint8)
            row = {"workflow": workflow, "prompt": prompt, "seed": seed, "png": _png_name(index)}
            if pixels.ndim == 4:  # a clip [F, H, W, 3]: its frames one under another in one PNG
                row["frames"] = pixels.shape[0]
                pixels = pixels.reshape(-1, *pixels.shape[2:])
            Image.fromarray(pixels).save(buffer, format="PNG")
            (staging / _png_name(index)).write_bytes(buffer.getvalue())
            rows.append(row)
        document = {"schema_version": BASELINE_SCHEMA_VERSION, "created_at": datetime.now(UTC).isoformat(),
                    "model": baseline.model, "target": baseline.target, "engine_keys": sorted(baseline.engine_keys),
                    "size": baseline.size, "steps": baseline.steps, "guidance_scale": baseline.guidance_scale,
                    "images": rows}
        (staging / BASELINE_FILE).write_text(json.dumps(document, indent=2))
        old = None
        if folder.exists():
            old = folder.parent / f".{folder.name}.old.{os.getpid()}"
            os.replace(folder, old)
        os.replace(staging, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder
