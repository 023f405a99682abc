"""`trt-diffusion --version`: installed versions read from package metadata (nothing imported: it answers
at once, without loading torch)."""

from __future__ import annotations

from importlib import metadata

# (shown name, distributions that provide it: the first one installed answers)
ENGINE_PACKAGES = (
    ("torch", ("torch",)),
    ("diffusers", ("diffusers",)),
    ("onnxruntime", ("onnxruntime", "onnxruntime-gpu")),
    ("openvino", ("openvino",)),
    ("tensorrt", ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt-cu13-bindings", "tensorrt-cu12-bindings")),
)


def _installed(distributions: tuple[str, ...]) -> str | None:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_lines() -> list[str]:
    lines = [f"trt-diffusion {_installed(('trt-diffusion',)) or 'unknown (not installed)'}"]
    for shown, distributions in ENGINE_PACKAGES:
        lines.append(f"  {shown:<12} {_installed(distributions) or 'not installed'}")
    return lines
