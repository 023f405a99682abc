"""One function per stage. The CLI and the Makefile call these; they know nothing about argv."""

from __future__ import annotations

from pathlib import Path

from .plan import Plan, make_plan
from .spec import load_engines_file


def plan(config_path: str | Path, *, count_parameters: bool = True) -> Plan:
    """Expand engines.yaml into the engine matrix, with counts, reasons and disk estimates."""
    config = load_engines_file(config_path, check_sources=True)
    return make_plan(config, count_parameters=count_parameters)


def make_tiny_model(out_dir: str | Path, family: str, *, seed: int = 0, size: str = "tiny",
                    controlnet: bool = False, lora: bool = False, overwrite: bool = False) -> Path:
    """Write a seeded reference pipeline folder (see models/tiny.py)."""
    from .models.tiny import write_tiny_model

    return write_tiny_model(out_dir, family, seed=seed, size=size, controlnet=controlnet, lora=lora,
                            overwrite=overwrite)
