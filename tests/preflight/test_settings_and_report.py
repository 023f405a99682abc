"""The `preflight:` block (file:line errors), check selection, the report model and page; no server, no engines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trt_diffusion.checklist import CHECK_NAMES
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.errors import ConfigError
from trt_diffusion.preflight.errors import PreflightError
from trt_diffusion.preflight.model import CheckResult, PreflightReport
from trt_diffusion.preflight.run import select

BASE = """version: 1
models:
  sd15-tiny:
    source: {source}
    family: sd15
    buckets: ["64x64"]
    targets: [onnxruntime]
"""


def write(tmp_path, tiny_sd15_dir, block: str):
    path = tmp_path / "engines.yaml"
    path.write_text(BASE.format(source=tiny_sd15_dir) + block)
    return path


def test_block_is_optional_with_defaults(tmp_path, tiny_sd15_dir):
    config = load_engines_file(write(tmp_path, tiny_sd15_dir, ""))
    assert config.preflight.overload.duration_s == 10.0 and config.preflight.overload.load_factor == 1.5
    assert config.preflight.memory.max_rss_gb == 16.0 and config.preflight.target == "onnxruntime"


@pytest.mark.parametrize("block,message", [
    ("preflight:\n  overload:\n    duraton_s: 5\n", r"engines.yaml:10: preflight.overload.duraton_s"),
    ("preflight:\n  overload:\n    duration_s: 6000\n", r"engines.yaml:10: preflight.overload.duration_s"),
    ("preflight:\n  memory: {max_rss_gb: -1}\n", r"engines.yaml:9: preflight.memory.max_rss_gb"),
    ("preflight:\n  model: other\n", r"engines.yaml:9: preflight.model: no model named 'other'"),
    ("preflight:\n  target: tensorrt\n", r"engines.yaml:9: preflight.target: sd15-tiny does not build the tensorrt"),
])
def test_bad_block_is_a_config_error_with_file_and_line(tmp_path, tiny_sd15_dir, block, message):
    with pytest.raises(ConfigError, match=message):
        load_engines_file(write(tmp_path, tiny_sd15_dir, block))


def test_only_and_skip():
    assert select(None, None) == list(CHECK_NAMES)
    assert select(["quality", "buckets"], None) == ["buckets", "quality"]
    assert select(None, ["overload"]) == [n for n in CHECK_NAMES if n != "overload"]
    with pytest.raises(PreflightError, match="unknown check 'speed'; checks: reproducibility, buckets"):
        select(["speed"], None)
    with pytest.raises(PreflightError, match="leave no check"):
        select(["quality"], ["quality"])


def result(name: str, status: str, **values) -> CheckResult:
    values.setdefault("failures", ["broken"] if status == "fail" else [])
    values.setdefault("reason", "why" if status == "n/a" else None)
    return CheckResult(name=name, title=name.title(), status=status, summary=f"{name} summary", seconds=0.1,
                       timeout_s=10, **values)


def report(checks):
    return PreflightReport.build(config="engines.yaml", model="m", target="onnxruntime",
                                 deployment={"kind": "served", "pipeline": "m"}, checks=checks, not_run=[])


def test_report_verdict_and_consistency():
    assert report([result("buckets", "pass"), result("overload", "n/a")]).passed
    assert not report([result("buckets", "pass"), result("quality", "fail")]).passed
    assert not report([]).passed  # checking nothing proves nothing
    with pytest.raises(ValueError, match="failures"):
        result("buckets", "fail", failures=[])
    with pytest.raises(ValueError, match="reason"):
        result("buckets", "n/a", reason=None)


def test_json_round_trips_infinity_and_the_page_escapes(tmp_path):
    from trt_diffusion.preflight.files import read_report, write_report

    checks = [result("quality", "pass", figures={"min_psnr_db": float("inf")},
                     rows=[{"prompt": "<script>alert(1)</script>", "psnr_db": float("inf")}])]
    files = write_report(report(checks), tmp_path)
    raw = json.loads(files.json.read_text())
    assert raw["checks"][0]["figures"]["min_psnr_db"] == "Infinity"
    assert read_report(files.json).checks[0].figures["min_psnr_db"] == float("inf")
    html = files.html.read_text()
    assert "<script>alert" not in html and "&lt;script&gt;" in html and "Preflight report" in html
    schema = json.loads(files.schema.read_text())
    assert schema["additionalProperties"] is False and "checks" in schema["properties"]


def test_cli_start_does_not_import_heavy_modules():
    code = ("import sys, trt_diffusion.cli; heavy = [m for m in ('torch', 'tritonclient', 'trt_diffusion.engines_file', "
            "'numpy', 'trt_diffusion.preflight.run') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
