"""No code of trt-diffusion names a TensorRT API that TensorRT 11 removed.

The list is NVIDIA's "Migrating from TensorRT 10.x to 11.x" guide, "Removed Python APIs and Replacements"
(docs.nvidia.com/deeplearning/tensorrt/latest/api/migration/tensorrt-10x-to-11x-python-api-reference.html),
with the C++ reference page of the same guide for the classes the Python page lists by their C++ names,
and the TensorRT 11.0 Python API reference for NetworkDefinitionCreationFlag (EXPLICIT_BATCH is gone; only
STRONGLY_TYPED, deprecated and ignored, and the two plugin flags remain) and Builder (no platform_has_*).
The TensorRT 10.13 stubs still declare all of these, so the type check cannot catch them: this scan does.

The scan reads the Python AST of every module of the package and of scripts/ (attribute names, names,
getattr with a literal, Polygraphy's CreateConfig precision keywords) and trtexec command lines in shell
scripts; test_the_scan_finds_every_kind_of_use proves on every run that it can fail.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = [REPO / "trt_diffusion", REPO / "scripts"]

# Enum members removed in 11.x, by enum
REMOVED_MEMBERS = {
    # "Strong typing with ModelOpt AutoCast" (FP16, BF16), "Explicit quantization with Q/DQ nodes" (INT8, FP8,
    # INT4, FP4), "Strong typing (always enforced)" (the precision constraints), DIRECT_IO "Removed (unneeded)"
    "BuilderFlag": {"FP16", "BF16", "INT8", "FP8", "INT4", "FP4", "OBEY_PRECISION_CONSTRAINTS",
                    "PREFER_PRECISION_CONSTRAINTS", "DIRECT_IO"},
    "NetworkDefinitionCreationFlag": {"EXPLICIT_BATCH"},
}
# Attributes and methods removed in 11.x (distinctive names: matched on any receiver)
REMOVED_ATTRIBUTES = {
    # IBuilderConfig: "Explicit quantization with Q/DQ nodes"
    "int8_calibrator", "set_calibration_profile", "get_calibration_profile", "set_quantization_flag",
    "get_quantization_flag", "quantization_flags", "clear_quantization_flag",
    # IBuilderConfig.algorithm_selector: "Use editable mode in ITimingCache instead"
    "algorithm_selector",
    # ICudaEngine: replaced by the _v2 forms
    "device_memory_size", "get_device_memory_size_for_profile",
    # Builder: "use strongly typed networks / explicit quantization instead of querying platform support"
    "platform_has_fast_fp16", "platform_has_fast_int8", "platform_has_tf32",
    # ILayer per-layer precision (weak typing): strong typing decides every tensor's type
    "set_output_type", "reset_output_type", "output_type_is_set", "reset_precision", "precision_is_set",
}
# Classes removed in 11.x
REMOVED_CLASSES = {
    "IInt8Calibrator", "IInt8LegacyCalibrator", "IInt8EntropyCalibrator", "IInt8EntropyCalibrator2",
    "IInt8MinMaxCalibrator", "CalibrationAlgoType", "QuantizationFlag",
    "IAlgorithm", "IAlgorithmContext", "IAlgorithmIOInfo", "IAlgorithmSelector", "IAlgorithmVariant",
}
# Polygraphy's CreateConfig sets BuilderFlag.FP16/BF16/INT8/FP8 for these keywords
CREATE_CONFIG_PRECISION_KEYWORDS = {"fp16", "bf16", "int8", "fp8", "int4", "fp4", "precision_constraints", "calibrator"}
# trtexec options that set the removed flags ("trtexec Command-Line Usage" page of the guide)
REMOVED_TRTEXEC_OPTIONS = re.compile(r"trtexec\b[^\n]*?\s--(fp16|bf16|int8|fp8|int4|fp4|best|precisionConstraints|"
                                     r"layerPrecisions|layerOutputTypes|calib)\b")


def _name_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def removed_api_uses(source: str, filename: str = "<source>") -> list[str]:
    """'file:line: what' for every use of an API TensorRT 11 removed."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        what = None
        if isinstance(node, ast.Attribute):
            owner = _name_of(node.value)
            if owner in REMOVED_MEMBERS and node.attr in REMOVED_MEMBERS[owner]:
                what = f"{owner}.{node.attr}"
            elif node.attr in REMOVED_ATTRIBUTES or node.attr in REMOVED_CLASSES:
                what = node.attr
        elif isinstance(node, ast.Name) and node.id in REMOVED_CLASSES:
            what = node.id
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("tensorrt", "tensorrt_bindings"):
            names = sorted(a.name for a in node.names if a.name in REMOVED_CLASSES | REMOVED_ATTRIBUTES)
            what = ", ".join(names) or None
        elif isinstance(node, ast.Call):
            called = _name_of(node.func)
            if called == "getattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                owner, member = _name_of(node.args[0]), node.args[1].value
                if member in REMOVED_MEMBERS.get(owner or "", ()) or member in REMOVED_ATTRIBUTES:
                    what = f"getattr({owner}, {member!r})"
            elif called == "CreateConfig":
                used = sorted(k.arg for k in node.keywords if k.arg in CREATE_CONFIG_PRECISION_KEYWORDS)
                if used:
                    what = f"CreateConfig({', '.join(used)}=...) (sets removed precision flags)"
        if what:
            found.append(f"{filename}:{getattr(node, 'lineno', '?')}: {what}")
    return found


def removed_trtexec_options(text: str, filename: str) -> list[str]:
    return [f"{filename}:{text.count(chr(10), 0, m.start()) + 1}: trtexec --{m.group(1)}"
            for m in REMOVED_TRTEXEC_OPTIONS.finditer(text)]


def scanned_files() -> list[Path]:
    return sorted(p for root in SCANNED if root.is_dir() for p in root.rglob("*")
                  if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts)


def test_no_code_names_an_api_tensorrt_11_removed():
    files = scanned_files()
    assert any(p.name == "engine.py" and p.parent.name == "tensorrt" for p in files)
    found = []
    for path in files:
        text = path.read_text()
        name = str(path.relative_to(REPO))
        if path.suffix == ".py":
            found += removed_api_uses(text, name)
        found += removed_trtexec_options(text, name)
    assert not found, "APIs removed in TensorRT 11 (see the migration guide):\n" + "\n".join(found)


@pytest.mark.parametrize("snippet, expected", [
    ("config.set_flag(trt.BuilderFlag.FP16)", "BuilderFlag.FP16"),
    ("config.set_flag(tensorrt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)", "BuilderFlag.OBEY_PRECISION_CONSTRAINTS"),
    ("flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)", "NetworkDefinitionCreationFlag.EXPLICIT_BATCH"),
    ("config.int8_calibrator = calibrator", "int8_calibrator"),
    ("size = engine.device_memory_size", "device_memory_size"),
    ("if builder.platform_has_fast_fp16: pass", "platform_has_fast_fp16"),
    ("layer.set_output_type(0, trt.float16)", "set_output_type"),
    ("class C(trt.IInt8EntropyCalibrator2): pass", "IInt8EntropyCalibrator2"),
    ("from tensorrt import IAlgorithmSelector", "IAlgorithmSelector"),
    ("x = IAlgorithmSelector()", "IAlgorithmSelector"),
    ("config.set_flag(getattr(trt.BuilderFlag, 'BF16'))", "getattr(BuilderFlag, 'BF16')"),
    ("CreateConfig(fp16=True, tf32=True)", "CreateConfig(fp16=...)"),
])
def test_the_scan_finds_every_kind_of_use(snippet, expected):
    found = removed_api_uses(snippet)
    assert found and expected in found[0], found


def test_the_scan_leaves_what_11_keeps_alone():
    kept = ("config.set_flag(trt.BuilderFlag.REFIT)\nconfig.clear_flag(trt.BuilderFlag.TF32)\n"
            "n = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)\nm = engine.device_memory_size_v2\n"
            "CreateConfig(tf32=True, refittable=True)\nspec.precision\nget_device_memory_size_for_profile_v2(0)\n")
    assert removed_api_uses(kept) == []
    assert removed_trtexec_options("trtexec --onnx=m.onnx --stronglyTyped --saveEngine=e.plan\n", "x.sh") == []
    assert removed_trtexec_options("echo\ntrtexec --onnx=m.onnx --fp16\n", "x.sh") == ["x.sh:2: trtexec --fp16"]


def test_builder_flags_of_every_spec_are_kept_in_11():
    from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
    from trt_diffusion.targets.tensorrt.config import KNOWN_PRECISIONS, QUANTIZED_PRECISIONS, BuildFlags

    for precision in KNOWN_PRECISIONS:
        for refittable in (False, True) if precision not in QUANTIZED_PRECISIONS else (False,):
            for options in ({}, {"tensorrt_tf32": False, "tensorrt_version_compatible": True}):
                spec = EngineSpec(model="m", family="sd15", source="s", component="unet", target="tensorrt",
                                  precision=precision, batch=1, bucket=Bucket.static(Size(512, 512)),
                                  refittable=refittable, build_options=tuple(sorted(options.items())))
                flags = BuildFlags.for_spec(spec, precision in QUANTIZED_PRECISIONS)
                names = set(flags.builder_flags()) | set(flags.cleared_builder_flags())
                assert not names & REMOVED_MEMBERS["BuilderFlag"], (precision, names)
                assert names <= {"REFIT", "STRIP_PLAN", "VERSION_COMPATIBLE", "TF32"}
