"""Built engines of a model, and the RunnerTable that routes a request to them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..engines_file import EnginesConfig, EngineSpec, expand
from ..errors import BuildError
from ..families import Component, Family
from ..targets import get_target
from ..targets.base import BuiltEngine
from .cfg_parallel import cfg_instances
from .engines import RunnerTable


def _variant_name(spec: EngineSpec) -> str | None:
    return spec.lora_variant.name if spec.lora_variant else None


def built_engines(config: EnginesConfig, model_name: str, target: str, *, lora_variant: str | None = None,
                  specs: list[EngineSpec] | None = None) -> list[BuiltEngine]:
    """Every engine the plan wants for this model and target, checked to be built and trusted."""
    if model_name not in config.models:
        raise BuildError(f"no model named {model_name!r} in {config.path} (models: {', '.join(config.models)})")
    wanted = [s for s in (specs or expand(config)) if s.model == model_name and s.target == target
              and (not s.component.is_denoiser or _variant_name(s) == lora_variant)]
    if not wanted:
        raise BuildError(f"{model_name} has no {target} engines in {config.path}")
    from ..workspace.store_sync import pull_engines

    pull_engines(config, [spec.key for spec in wanted])  # a URL workspace: a serving host pulls what was built
    engines, missing = [], []
    for spec in wanted:
        found = _find(config, spec)
        if found is None:
            missing.append(spec.name)
        else:  # with the model's serving settings: how its runners run it (a TensorRT weight budget)
            serving = getattr(config.models[model_name], "serving", None)
            engines.append(dataclasses.replace(found, serving=serving) if isinstance(found, BuiltEngine) else found)
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


def table_from_engines(engines: list[BuiltEngine], make_runner=runner_for, *, cfg=()) -> RunnerTable:
    """One entry per engine shape: a multi-profile engine (engine_layout: profiles) is one runner with an entry per
    profile, its bucket, batch and profile index (the table routes a request to (engine, profile)). `cfg`: the
    model's CFG modes; with `parallel`, the engines CFG calls twice a step get a second runner (a second session:
    runtime/cfg_parallel.py), so the two calls of a step run at once."""
    table = RunnerTable()
    for engine in engines:
        spec = engine.spec
        runners = [make_runner(engine) for _ in range(cfg_instances(spec.component, cfg))]
        members = spec.members
        for index, member in enumerate(members):
            table.add(spec.label, runners[0], bucket=member.bucket, batch=member.batch, controlnet=spec.controlnet,
                      profile=index if len(members) > 1 else None, instances=tuple(runners[1:]))
    return table


def engine_runners(config: EnginesConfig, model_name: str, target: str, *, lora_variant: str | None = None,
                   loras: list[tuple[Path, float]] | None = None) -> tuple[Path, Family, RunnerTable]:
    """Runners over the built engines of a model. `loras` (file, scale) are refitted into the refittable
    engines: the denoiser's part into the denoiser, the text encoders' parts into the text encoders; computed
    from the base weights every time, so switching LoRAs leaves no residue. A part no refittable engine takes
    raises RefitError (nothing is dropped)."""
    engines = built_engines(config, model_name, target, lora_variant=lora_variant)
    model = config.models[model_name]
    if not loras:
        return model.source.path, model.family, table_from_engines(engines, cfg=model.cfg)
    weights = refit_weights(config, model_name, loras, refittable={e.spec.component for e in engines
                                                                   if e.spec.refittable})

    def make(engine: BuiltEngine):
        return runner_for(engine, weights=weights.get(engine.spec.component) if engine.spec.refittable else None)

    return model.source.path, model.family, table_from_engines(engines, make, cfg=model.cfg)


def refit_weights(config: EnginesConfig, model_name: str, loras: list[tuple[Path, float]],
                  refittable=None) -> dict[str, dict]:
    """Fused weights per component (component -> torch parameter name -> tensor) for these LoRAs at these
    scales. `refittable`: the components whose engines take weights (default: the denoiser and the
    LoRA-capable text encoders the model builds). Components no LoRA touches are absent."""
    from functools import partial

    from ..engine_builds.stage import base_module
    from ..families import LORA_TEXT_ENCODERS, family_info
    from ..lora import pipeline_lora_weights

    model = config.models[model_name]
    info = family_info(model.family)
    capable = (info.denoiser, *LORA_TEXT_ENCODERS[model.family])
    if refittable is None:
        refittable = {c.value for c in capable if c in model.components}
    refittable = {Component(c).value for c in refittable}
    refusals = {}
    for component in (*info.components, Component.controlnet):
        if component.value in refittable:
            continue
        if component not in capable:
            refusals[component.value] = (f"the {model.family.value} family's {component.value} takes no LoRA "
                                         "weights here (diffusers does not load them either)")
        elif component not in model.components:
            refusals[component.value] = (f"{model_name} builds no {component.value} engine (components: "
                                         f"{', '.join(c.value for c in model.components)}); add it to take this part")
        else:
            refusals[component.value] = (f"the {component.value} engines of {model_name} are not refittable; "
                                         "rebuild them with a `mode: refit` LoRA or `refittable: true` in engines.yaml")
    modules = {c: partial(base_module, config, model_name, c) for c in sorted(refittable)}
    return pipeline_lora_weights(modules, [(Path(p), float(s)) for p, s in loras], denoiser=info.denoiser.value,
                                 refusals=refusals)
