"""`--model` / `--component`: pick the specs to export, with a clear error for a selection that cannot exist."""

from __future__ import annotations

from ..errors import ConfigError
from ..families import Component, family_info
from .engine_spec import EngineSpec
from .expand import expand
from .load import EnginesConfig, ResolvedModel


def select_specs(config: EnginesConfig, model: str | None = None, component: str | None = None) -> list[EngineSpec]:
    models = list(config.models.values())
    if model is not None:
        if model not in config.models:
            raise ConfigError(f"no model {model!r} in {config.path} (models: {', '.join(config.models)})")
        models = [config.models[model]]
    wanted = _parse_component(component) if component is not None else None
    if wanted is not None:
        problems = [p for p in (_lacks(m, wanted) for m in models) if p]
        if len(problems) == len(models):
            raise ConfigError("; ".join(problems))
    names = {m.name for m in models}
    return [s for s in expand(config)
            if s.model in names and (wanted is None or s.component == wanted.value)]


def _parse_component(component: str) -> Component:
    try:
        return Component(component)
    except ValueError:
        known = ", ".join(c.value for c in Component)
        raise ConfigError(f"unknown component {component!r} (known: {known})") from None


def _lacks(model: ResolvedModel, component: Component) -> str | None:
    """Why `model` has nothing to export for `component`, or None when it has."""
    info = family_info(model.family)
    if component not in info.components:
        have = ", ".join(c.value for c in info.components)
        return f"the {model.family.value} family has no {component.value} (model {model.name!r}; the family has: {have})"
    if component is Component.controlnet:
        return None if model.controlnets else f"model {model.name!r} lists no controlnets"
    if component not in model.components:
        listed = ", ".join(c.value for c in model.components)
        return f"model {model.name!r} does not list {component.value} in its components ({listed})"
    return None
