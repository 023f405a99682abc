"""Calibration prompt sets: the bundled default or a user file, one prompt a line."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..errors import QuantizeError
from ..models.micro import draws_synthetic_world
from ..synthetic_world import calibration_captions

BUNDLED_PROMPTS = "calibration_prompts.txt"

# Held out from calibration: the quality gate runs these (with other seeds) so it measures inputs the
# scales were not fitted to. None of them is in the bundled set.
HELD_OUT_PROMPTS = (
    "a lone tree on a hill under a purple sunset sky",
    "a bright kitchen with copper pots hanging over a marble island",
    "a paper boat floating down a city gutter after the rain",
    "a snow leopard resting on a rocky ledge, telephoto",
)


def _parse(text: str, where: str) -> list[str]:
    prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise QuantizeError(f"{where}: no prompts (one prompt a line; '#' starts a comment)")
    return prompts


def load_prompts(path: str | Path | None, root: Path | None = None,
                 model_dir: str | Path | None = None) -> tuple[list[str], str]:
    """The prompt list and where it came from. A relative `path` is read from `root` (engines.yaml's folder).
    With no file, a model that declares the synthetic world (a trained micro-model) calibrates on that world's
    captions outside its evaluation grid: the bundled prompts are words it never learned."""
    if path is None and model_dir is not None and draws_synthetic_world(model_dir):
        return calibration_captions(), "synthetic-world"
    if path is None:
        text = resources.files("trt_diffusion").joinpath("data", BUNDLED_PROMPTS).read_text(encoding="utf-8")
        return _parse(text, f"bundled {BUNDLED_PROMPTS}"), f"bundled:{BUNDLED_PROMPTS}"
    file = Path(path)
    if not file.is_absolute() and root is not None:
        file = root / file
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise QuantizeError(f"calibration prompts file {file} cannot be read: {exc.strerror or exc}") from None
    return _parse(text, str(file)), f"file:{file.name}"


def take(prompts: list[str], count: int) -> list[str]:
    """`count` prompts, cycling through the list when it is shorter (each cycle gets its own seed)."""
    return [prompts[i % len(prompts)] for i in range(count)]
