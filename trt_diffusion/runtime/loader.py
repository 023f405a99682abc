"""Built engines of a model, and the RunnerTable that routes a request to them."""

from __future__ import annotations

from pathlib import Path

from ..errors import BuildError
from ..families import Component, Family
from ..spec import EngineSpec, EnginesConfig, expand
from ..targets import get_target
from ..targets.base import BuiltEngine
from .engines import RunnerTable


def _variant_name(spec: EngineSpec) -> str | None:
    return spec.lora_variant.name if spec.lora_variant else None


def built_engines(config: EnginesConfig, model_name: str, target: str, *, lora_variant: str | None = None,
                  specs: list[EngineSpec] | None = None) -> list[BuiltEngine]:
    """Every engine the plan wants for this model and target, checked to be built and trusted."""
    if model_name not in config.models:
        raise BuildError(f"no model named {model_name!r} in {config.path} (models: {', '.join(config.models)})")
    wanted = [s for s in (specs or expand(config)) if s.model == model_name and s.target == target
              and (not Component(s.component).is_denoiser or _variant_name(s) == lora_variant)]
    if not wanted:
        raise BuildError(f"{model_name} has no {target} engines in {config.path}")
    engines, missing = [], []
    for spec in wanted:
        found = _find(config, spec)
        if found is None:
            missing.append(spec.name)
        else:
            engines.append(found)
    if missing:
        raise BuildError(f"{len(missing)} {target} engine(s) of {model_name} are not built ({', '.join(missing[:4])}"
                         f"{', …' if len(missing) > 4 else ''}); run `trt-diffusion build {config.path} "
                         f"--target {target}`")
    return engines


def _find(config: EnginesConfig, spec: EngineSpec) -> BuiltEngine | None:
    return get_target(spec.target).find(Path(config.workspace), spec)


def runner_for(engine: BuiltEngine, *, weights=None):
    """A runner over the engine; `weights` (fused LoRA weights, torch names) refit a refittable engine."""
    return get_target(engine.spec.target).runner(engine, weights)


def table_from_engines(engines: list[BuiltEngine], make_runner=runner_for) -> RunnerTable:
    table = RunnerTable()
    for engine in engines:
        spec = engine.spec
        table.add(spec.component, make_runner(engine), bucket=spec.bucket, batch=spec.batch,
                  controlnet=spec.controlnet)
    return table


def engine_runners(config: EnginesConfig, model_name: str, target: str, *, lora_variant: str | None = None,
                   loras: list[tuple[Path, float]] | None = None) -> tuple[Path, Family, RunnerTable]:
    """Runners over the built engines of a model. `loras` (file, scale) are refitted into the refittable
    denoiser engines: computed from the base weights every time, so switching LoRAs leaves no residue."""
    engines = built_engines(config, model_name, target, lora_variant=lora_variant)
    model = config.models[model_name]
    if not loras:
        return model.source.path, model.family, table_from_engines(engines)
    weights = refit_weights(config, model_name, loras)

    def make(engine: BuiltEngine):
        return runner_for(engine, weights=weights if engine.spec.refittable else None)

    return model.source.path, model.family, table_from_engines(engines, make)


def refit_weights(config: EnginesConfig, model_name: str, loras: list[tuple[Path, float]]):
    """Fused denoiser weights (torch parameter name -> tensor) for these LoRAs at these scales."""
    from ..lora import lora_deltas
    from ..targets.stage import base_denoiser

    return lora_deltas(base_denoiser(config, model_name), [(Path(p), float(s)) for p, s in loras])
