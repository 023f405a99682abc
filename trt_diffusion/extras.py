"""The optional-dependency gate: one place that knows which extra of pyproject.toml's `optional-dependencies`
a feature needs, and one message when it is missing.

A command that asks for an extra's feature (`serve --openai-port`, `openai-api`, `build --target openvino`,
`build --ray`, an `s3://` workspace, `build --target tensorrt`) calls `require(extra, feature)` before it starts
anything: where a module of the extra cannot be imported, `MissingDependencyError` (exit 1, no traceback) names
the feature, the module and `pip install 'trt-diffusion[extra]'` — as diffusers' `requires_backends` does.
A target listed only in engines.yaml's `defaults.targets` is not asked for: the build skips it with
`missing(...)`'s reason instead. On the ground floor: it imports nothing of the package but `errors`, and the
extra's modules only when asked.
"""

from __future__ import annotations

import importlib

from .errors import MissingDependencyError

# extra -> the top-level modules its features import (`module:attribute` where importing is not proof enough)
EXTRAS: dict[str, tuple[str, ...]] = {
    # python-multipart: FastAPI's form uploads (/v1/images/edits); prometheus_client: the replicas' queue metrics
    "openai": ("fastapi", "uvicorn", "python_multipart", "prometheus_client"),
    "farm": ("ray",),
    "store": ("fsspec", "s3fs"),
    "openvino": ("openvino",),
    # tensorrt-stubs (the type check's .pyi) and NVIDIA's placeholder package import without the libraries
    "tensorrt": ("tensorrt:Builder",),
}
# TensorRT's wheels come from NVIDIA's index, not PyPI
_INDEX = {"tensorrt": " --extra-index-url https://pypi.nvidia.com"}


def install_line(extra: str) -> str:
    """The one pip line that installs an extra."""
    if extra not in EXTRAS:
        raise KeyError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    return f"pip install 'trt-diffusion[{extra}]'{_INDEX.get(extra, '')}"


def missing(extra: str, modules: tuple[str, ...] | None = None) -> str | None:
    """None when every module of `extra` (or `modules` of it) imports, else why the first one does not, with the
    pip line."""
    for entry in EXTRAS[extra] if modules is None else modules:
        name, _, attribute = entry.partition(":")
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            return f"{name} cannot be imported ({exc}); install the {extra} extra: {install_line(extra)}"
        except OSError as exc:  # a wheel whose shared libraries are missing
            return f"{name} cannot be loaded ({exc}); install the {extra} extra: {install_line(extra)}"
        if attribute and not hasattr(module, attribute):
            return (f"the installed {name!r} package has no {attribute} (a stub or placeholder package); install the "
                    f"{extra} extra: {install_line(extra)}")
    return None


def require(extra: str, feature: str, modules: tuple[str, ...] | None = None) -> None:
    """MissingDependencyError naming `feature` and the pip line when `extra` (or `modules` of it) is missing."""
    reason = missing(extra, modules)
    if reason is not None:
        raise MissingDependencyError(f"{feature} needs the {extra} extra: {reason}")


__all__ = ["EXTRAS", "install_line", "missing", "require"]
