"""No code of trt-diffusion names a TensorRT API that TensorRT 11 removed.

The list is generated from the source, not kept by hand (#27 item 9): `scripts/tensorrt_removed_api.py` diffed
the pybind11 binding sources (`python/src/**/*.cpp`, tensorrt and its ONNX parser) of NVIDIA/TensorRT's
`release/10.13` and `release/11.1` branches and wrote `trt_diffusion/targets/tensorrt/removed_api.json`, with the
commits it read. Regenerate it with the script against a clone of github.com/NVIDIA/TensorRT. What bindings cannot
say stays hand-kept below: trtexec's removed options and Polygraphy's CreateConfig precision keywords (both from
NVIDIA's "Migrating from TensorRT 10.x to 11.x" guide). The TensorRT 10.13 stubs still declare every removed
name, so the type check cannot catch them: this scan does.

The scan reads the Python AST of every module of the package and of scripts/ (attribute names, names,
getattr with a literal, Polygraphy's CreateConfig precision keywords) and trtexec command lines in shell
scripts; test_the_scan_finds_every_kind_of_use proves on every run that it can fail.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = [REPO / "trt_diffusion", REPO / "scripts"]
GENERATED = REPO / "trt_diffusion" / "targets" / "tensorrt" / "removed_api.json"
REMOVED = json.loads(GENERATED.read_text())
# Removed members whose name is a common word our own code uses for other things (`spec.precision`): matched on
# no receiver (a scan on any receiver would flag every engine spec). ILayer.precision is weak typing, gone with it.
GENERIC_NAMES = {"precision"}
# the generator's own source names them in strings only; nothing else may
EXEMPT = {REPO / "scripts" / "tensorrt_removed_api.py"}
SOURCE_ENV = "TRT_DIFFUSION_TENSORRT_GIT_DIR"  # a clone of github.com/NVIDIA/TensorRT: the list is regenerated and compared

# Enum members removed in 11.x, by enum
REMOVED_MEMBERS = {enum: set(members) for enum, members in REMOVED["enum_members"].items()}
# Attributes and methods removed in 11.x from a class that still exists (distinctive names: matched on any receiver)
REMOVED_ATTRIBUTES = {name for names in REMOVED["members"].values() for name in names} - GENERIC_NAMES
# Classes removed in 11.x
REMOVED_CLASSES = set(REMOVED["classes"])
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
                  if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts and p not in EXEMPT)


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
    from trt_diffusion.precision import PRECISIONS, QUANTIZED
    from trt_diffusion.targets.tensorrt.build_flags import BuildFlags

    for precision in PRECISIONS:
        for refittable in (False, True) if precision not in QUANTIZED else (False,):
            for options in ({}, {"tensorrt_tf32": False, "tensorrt_version_compatible": True},
                            {"tensorrt_strip_plan": True, "tensorrt_weight_streaming": True}):
                spec = EngineSpec(model="m", family="sd15", source="s", component="unet", target="tensorrt",
                                  precision=precision, batch=1, bucket=Bucket.static(Size(512, 512)),
                                  refittable=refittable, build_options=tuple(sorted(options.items())))
                flags = BuildFlags.for_spec(spec, precision in QUANTIZED)
                names = set(flags.builder_flags()) | set(flags.cleared_builder_flags())
                assert not names & REMOVED_MEMBERS["BuilderFlag"], (precision, names)
                assert names <= {"REFIT", "REFIT_IDENTICAL", "STRIP_PLAN", "WEIGHT_STREAMING", "VERSION_COMPATIBLE",
                                  "TF32"}


def test_the_generated_list_has_its_provenance_and_the_names_a_hand_list_missed():
    provenance = REMOVED["provenance"]
    assert provenance["repository"] == "https://github.com/NVIDIA/TensorRT"
    assert (provenance["old"]["ref"], provenance["new"]["ref"]) == ("release/10.13", "release/11.1")
    assert all(re.fullmatch(r"[0-9a-f]{40}", provenance[side]["commit"]) for side in ("old", "new"))
    # what the hand-kept list of the migration guide missed (#27 item 9)
    assert {"weight_streaming_budget", "minimum_weight_streaming_budget",
            "create_execution_context_without_device_memory", "get_dynamic_range", "set_dynamic_range",
            "dynamic_range", "all_shape_inputs_specified", "supports_model"} <= REMOVED_ATTRIBUTES
    assert {"IStreamReader", "IInt8EntropyCalibrator2", "IAlgorithmSelector"} <= REMOVED_CLASSES
    assert {"FP16", "INT8", "WEIGHTLESS"} <= REMOVED_MEMBERS["BuilderFlag"]
    # kept in 11.1's bindings, whatever the guide said: STRIP_PLAN (WEIGHTLESS's alias), DIRECT_IO, the _v2 forms
    assert not {"STRIP_PLAN", "REFIT", "DIRECT_IO", "WEIGHT_STREAMING"} & REMOVED_MEMBERS["BuilderFlag"]
    assert not {"weight_streaming_budget_v2", "device_memory_size_v2", "IStreamReaderV2"} & (
        REMOVED_ATTRIBUTES | REMOVED_CLASSES)


def test_the_generator_reads_pybind11_bindings():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen", REPO / "scripts" / "tensorrt_removed_api.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    old = gen.bindings(['''
        py::class_<ICudaEngine> engine{m, "ICudaEngine", "doc"};
        engine.def("gone_v1", &f, "a; b").def_property_readonly("kept", [](ICudaEngine& e) { return 1; });
        py::enum_<BuilderFlag>(m, "BuilderFlag", R"trtdoc(FP16 (a) ; )trtdoc")
            .value("FP16", BuilderFlag::kFP16).value("REFIT", BuilderFlag::kREFIT);
        py::class_<IInt8Calibrator>(m, "IInt8Calibrator").def("get_batch", &g);
        m.def("get_plugin_registry", &h);
    '''])
    new = gen.bindings(['''
        py::class_<ICudaEngine>(m, "ICudaEngine").def_property_readonly("kept", &k);
        py::enum_<BuilderFlag>(m, "BuilderFlag").value("REFIT", BuilderFlag::kREFIT);
        m.def("get_plugin_registry", &h);
    '''])
    diff = gen.removed(old, new)
    assert diff["classes"] == ["IInt8Calibrator"] and diff["enum_members"] == {"BuilderFlag": ["FP16"]}
    assert diff["members"] == {"ICudaEngine": ["gone_v1"]} and diff["functions"] == []


@pytest.mark.skipif(not os.environ.get(SOURCE_ENV), reason=f"{SOURCE_ENV} names no clone of NVIDIA/TensorRT")
def test_the_committed_list_is_what_the_generator_writes(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "removed.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "tensorrt_removed_api.py"), "--git-dir",
                    os.environ[SOURCE_ENV], "--out", str(out)], check=True, capture_output=True)
    assert json.loads(out.read_text()) == REMOVED
