"""The target registry: a target's name -> `"module:Class"`, imported on first use.

On the ground floor so engines.yaml validation, export grouping and the CLI can name targets and ask a target's
hooks without importing any backend: the registry imports a target's module only when `get_target` is first
called for it, by name. A target whose module fails to import stays registered: `get_target` then raises
`MissingDependencyError` with the reason, and `availability()` reports it. The targets themselves live in
`targets/` (one package or module per backend behind `targets.base.Target`).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ConfigError, MissingDependencyError

if TYPE_CHECKING:
    from .targets.base import Target


@dataclass(frozen=True)
class _Entry:
    locator: str | Target  # "package.module:Class", or an instance (targets defined at run time, e.g. tests)
    in_default: bool  # part of engines.yaml's default `targets` when a file lists none
    extra: str | None = None  # the pyproject extra its backend comes from (extras.py), checked when asked for


_REGISTRY: dict[str, _Entry] = {
    "tensorrt": _Entry("trt_diffusion.targets.tensorrt.target:TensorRTTarget", in_default=True,
                       extra="tensorrt"),
    "onnxruntime": _Entry("trt_diffusion.targets.onnxruntime:OnnxRuntimeTarget", in_default=True),
    # The `openvino` extra: skipped with the reason where OpenVINO is not installed, like tensorrt.
    "openvino": _Entry("trt_diffusion.targets.openvino:OpenVINOTarget", in_default=True, extra="openvino"),
}
_instances: dict[str, Target] = {}
_lock = threading.Lock()


def target_names() -> tuple[str, ...]:
    """Every registered target, in registration order."""
    return tuple(_REGISTRY)


def default_target_names() -> tuple[str, ...]:
    return tuple(name for name, entry in _REGISTRY.items() if entry.in_default)


def check_target_name(name: str) -> str:
    """`name` when it is a registered target, else ConfigError listing the known ones."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown target {name!r}; known targets: {', '.join(_REGISTRY)}")
    return name


def register_target(name: str, target: str | Target, *, in_default: bool = False, extra: str | None = None) -> None:
    """Register a target by `"module:Class"` (imported on first use) or as an instance. A name already taken is
    refused: a second registration would silently replace the first target's engines (unregister it first)."""
    with _lock:
        if name in _REGISTRY:
            raise ConfigError(f"target {name!r} is already registered ({_REGISTRY[name].locator!r}); "
                              "unregister_target it first to replace it")
        _REGISTRY[name] = _Entry(target, in_default, extra)
        _instances.pop(name, None)


def unregister_target(name: str) -> None:
    with _lock:
        _REGISTRY.pop(name, None)
        _instances.pop(name, None)


def require_target_extra(name: str, feature: str | None = None) -> None:
    """For a target asked for by name (`--target NAME`): MissingDependencyError with the pip line when the extra its
    backend comes from is missing (extras.require). Targets listed only in engines.yaml are skipped instead."""
    from .extras import require

    extra = _REGISTRY[check_target_name(name)].extra
    if extra is not None:
        require(extra, feature or f"--target {name}")


def get_target(name: str) -> Target:
    check_target_name(name)
    with _lock:
        if name not in _instances:
            entry = _REGISTRY[name]
            if isinstance(entry.locator, str):
                module_name, _, class_name = entry.locator.partition(":")
                try:
                    module = importlib.import_module(module_name)
                except ImportError as exc:
                    raise MissingDependencyError(f"the {name} target cannot be loaded: {exc}") from exc
                _instances[name] = getattr(module, class_name)()
            else:
                _instances[name] = entry.locator
        return _instances[name]


def availability() -> dict[str, str | None]:
    """target -> None when this host can build and run it, else the reason it cannot."""
    result: dict[str, str | None] = {}
    for name in _REGISTRY:
        try:
            result[name] = get_target(name).unavailable_reason()
        except MissingDependencyError as exc:
            result[name] = str(exc)
    return result


__all__ = ["availability", "check_target_name", "default_target_names", "get_target", "register_target",
           "require_target_extra", "target_names", "unregister_target"]
