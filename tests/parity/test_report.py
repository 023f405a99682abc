"""Parity report model, files (JSON, schema, PNGs, heatmaps, HTML) and the terminal summary."""

from __future__ import annotations

import json
import math
import os
from datetime import UTC, datetime
from html.parser import HTMLParser
from urllib.parse import unquote

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError
from rich.console import Console

from trt_diffusion.cli.parity_summary import render_summary
from trt_diffusion.metrics import Thresholds, tensor_diff, thresholds_for
from trt_diffusion.parity.report import (
    ComponentDiff,
    ImageComparison,
    ParityReport,
    VariantResult,
    compare_image,
    diff_heatmap,
    judge_report,
    judge_variant,
    read_report,
    write_report,
)
from trt_diffusion.parity.report import files as report_files

SCRIPT_PROMPT = "<script>alert('x')</script> & a cat"
NO_LPIPS = "LPIPS not computed: test"


# --- a minimal JSON Schema checker (jsonschema is not a dependency) --------------------------


def _schema_errors(instance, schema, root, where="$") -> list[str]:
    """The subset of JSON Schema that pydantic emits: $ref, type, properties, required,
    additionalProperties, items, anyOf, enum, const, minimum, maximum."""
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[-1]]
    errors: list[str] = []
    if "anyOf" in schema:
        if all(_schema_errors(instance, option, root, where) for option in schema["anyOf"]):
            errors.append(f"{where}: {instance!r} matches none of anyOf")
    if "enum" in schema and instance not in schema["enum"]:
        errors.append(f"{where}: {instance!r} not in {schema['enum']}")
    if "const" in schema and instance != schema["const"]:
        errors.append(f"{where}: {instance!r} != {schema['const']!r}")
    kind = schema.get("type")
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
    }
    if kind and not checks[kind](instance):
        return errors + [f"{where}: {instance!r} is not {kind}"]
    if "minimum" in schema and instance < schema["minimum"]:
        errors.append(f"{where}: {instance} < {schema['minimum']}")
    if "maximum" in schema and instance > schema["maximum"]:
        errors.append(f"{where}: {instance} > {schema['maximum']}")
    if kind == "object":
        properties = schema.get("properties", {})
        errors += [f"{where}: missing {key}" for key in schema.get("required", []) if key not in instance]
        extra = schema.get("additionalProperties")
        if extra is False:
            errors += [f"{where}: unexpected {key}" for key in instance if key not in properties]
        elif isinstance(extra, dict):
            for key in instance.keys() - properties.keys():
                errors += _schema_errors(instance[key], extra, root, f"{where}.{key}")
        for key, value in instance.items():
            if key in properties:
                errors += _schema_errors(value, properties[key], root, f"{where}.{key}")
    if kind == "array" and "items" in schema:
        for index, item in enumerate(instance):
            errors += _schema_errors(item, schema["items"], root, f"{where}[{index}]")
    return errors


def schema_errors(instance, schema) -> list[str]:
    return _schema_errors(instance, schema, schema)


# --- HTML parsing ----------------------------------------------------------------------------


class _PageParser(HTMLParser):
    """Collects the summary table's body rows (cell texts + classes), all <img> srcs and all tags."""

    def __init__(self):
        super().__init__()
        self.tags: list[str] = []
        self.images: list[str] = []
        self.summary_rows: list[list[tuple[str, str]]] = []
        self._in_summary = self._in_body = False
        self._cell: list[str] | None = None
        self._cell_class = ""

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        self.tags.append(tag)
        if tag == "table" and attributes.get("id") == "summary":
            self._in_summary = True
        elif tag == "tbody" and self._in_summary:
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self.summary_rows.append([])
        elif tag == "td" and self._in_body:
            self._cell, self._cell_class = [], attributes.get("class") or ""
        elif tag == "img":
            self.images.append(attributes["src"])

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.summary_rows[-1].append(("".join(self._cell), self._cell_class))
            self._cell = None
        elif tag == "table" and self._in_summary:
            self._in_summary = self._in_body = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def parse_page(text: str) -> _PageParser:
    parser = _PageParser()
    parser.feed(text)
    parser.close()
    return parser


# --- fixtures --------------------------------------------------------------------------------


def _gradient(height: int = 24, width: int = 32) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 7, y * 9, (x + y) * 4], axis=-1).astype(np.uint8)


def _noisy(image: np.ndarray, amplitude: int) -> np.ndarray:
    noise = np.random.default_rng(0).integers(-amplitude, amplitude + 1, image.shape)
    return np.clip(image.astype(np.int64) + noise, 0, 255).astype(np.uint8)


@pytest.fixture
def images() -> dict[str, np.ndarray]:
    reference = _gradient()
    return {
        "reference/seed0.png": reference,
        "ort-fp32/seed0.png": reference.copy(),
        "trt-fp8/seed0.png": _noisy(reference, 60),
    }


def _variant(variant_id, target, precision, images, candidate_png, **parts) -> VariantResult:
    thresholds = thresholds_for(precision)
    comparison = compare_image(
        prompt=SCRIPT_PROMPT,
        seed=0,
        reference=images["reference/seed0.png"],
        candidate=images[candidate_png],
        thresholds=thresholds,
        reference_png="reference/seed0.png",
        candidate_png=candidate_png,
        compute_lpips=False,
    )
    return judge_variant(
        variant_id=variant_id,
        model="sd15-tiny",
        target=target,
        precision=precision,
        bucket="32x24",
        thresholds=thresholds,
        images=[comparison],
        **parts,
    )


@pytest.fixture
def report(images) -> ParityReport:
    good = _variant(
        "sd15-tiny.onnxruntime.fp32", "onnxruntime", "fp32", images, "ort-fp32/seed0.png",
        components=[ComponentDiff.from_tensor_diff("unet", "out_sample", tensor_diff(np.ones(4), np.ones(4)))],
        reproducible=True,
        batch_independent=True,
    )
    bad = _variant("sd15-tiny.tensorrt.fp8", "tensorrt", "fp8", images, "trt-fp8/seed0.png", lora="style-a")
    return judge_report(
        [good, bad], tool_versions={"python": "3.11"}, created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    )


# --- model -----------------------------------------------------------------------------------


def test_variant_verdicts(report):
    good, bad = report.variants
    assert good.passed and good.failure_reasons == [] and good.images[0].psnr_db == math.inf
    assert not bad.passed and not bad.images[0].passed
    assert len(bad.failure_reasons) == 1
    assert bad.failure_reasons[0].startswith("image 0 (seed 0, ")
    assert "dB < 20 dB" in bad.failure_reasons[0] and "SSIM" in bad.failure_reasons[0]
    assert not report.passed


def test_judge_variant_rejudges_images_against_the_variant_thresholds(images):
    optimistic = ImageComparison(
        prompt="p", seed=1, psnr_db=25.0, ssim=0.99, lpips_reason=NO_LPIPS, passed=True,
        reference_png="r.png", candidate_png="c.png",
    )
    variant = judge_variant(
        variant_id="v", model="m", target="onnxruntime", precision="fp16", bucket="8x8",
        thresholds=thresholds_for("fp16"), images=[optimistic],
    )
    assert not variant.images[0].passed
    assert variant.failure_reasons == ["image 0 (seed 1, 'p'): PSNR 25.00 dB < 30 dB"]


def test_variant_failure_reasons_for_components_reproducibility_and_batching(images):
    broken = tensor_diff(np.zeros(3), np.array([np.nan, np.inf, 0.0]))
    variant = _variant(
        "v", "onnxruntime", "fp32", images, "ort-fp32/seed0.png",
        components=[ComponentDiff.from_tensor_diff("vae_decoder", "sample", broken)],
        reproducible=False,
        batch_independent=False,
    )
    assert variant.failure_reasons == [
        "vae_decoder.sample: 1 NaN and 1 inf values",
        "not reproducible: the same seed gave different images on two runs",
        "batch-dependent: an image changed with the batch it was generated in",
    ]
    assert not variant.passed


def test_a_variant_without_images_fails():
    variant = judge_variant(
        variant_id="v", model="m", target="tensorrt", precision="fp16", bucket="8x8",
        thresholds=thresholds_for("fp16"), images=[],
    )
    assert not variant.passed and variant.failure_reasons == ["no images were compared"]


def test_verdicts_must_agree_with_reasons(report):
    fields = report.variants[1].model_dump()
    with pytest.raises(ValidationError, match="marked passed but has failures"):
        VariantResult.model_validate({**fields, "passed": True})
    with pytest.raises(ValidationError, match="marked failed without a failure reason"):
        VariantResult.model_validate({**report.variants[0].model_dump(), "passed": False})
    with pytest.raises(ValidationError, match="report passed=True"):
        ParityReport.model_validate({**report.model_dump(), "passed": True})
    with pytest.raises(ValidationError, match="duplicate variant ids"):
        judge_report([report.variants[0], report.variants[0]])
    assert not judge_report([], tool_versions={}).passed  # nothing compared, nothing proven


def test_model_rejects_extra_fields_and_unsafe_png_names():
    base = dict(prompt="p", seed=0, psnr_db=40.0, ssim=1.0, lpips_reason=NO_LPIPS, passed=True, reference_png="r.png")
    with pytest.raises(ValidationError, match="extra"):
        ImageComparison(**base, candidate_png="c.png", surprise=1)
    for unsafe in ("../c.png", "/tmp/c.png", "a\\c.png", "c.jpg", "a//c.png"):
        with pytest.raises(ValidationError):
            ImageComparison(**base, candidate_png=unsafe)
    with pytest.raises(ValidationError, match="lpips_reason is required"):
        ImageComparison(**{**base, "lpips_reason": None}, candidate_png="c.png")


# --- files -----------------------------------------------------------------------------------


def test_write_report_writes_every_file(report, images, tmp_path):
    files = write_report(report, images, tmp_path / "out")
    out = tmp_path / "out"
    assert files.json == out / "parity.json" and files.schema == out / "parity.schema.json"
    assert files.html == out / "parity.html"
    assert sorted(p.relative_to(out).as_posix() for p in files.heatmaps) == [
        "ort-fp32/seed0.diff.png", "trt-fp8/seed0.diff.png"
    ]
    for path in (files.json, files.schema, files.html, *files.images, *files.heatmaps):
        assert path.is_file() and path.stat().st_size > 0
    assert [p.name for p in out.rglob("*.tmp")] == []  # temp files were renamed, none left behind
    for name, pixels in images.items():
        np.testing.assert_array_equal(np.asarray(Image.open(out / name)), pixels)


def test_json_round_trips_and_marks_inf_as_a_string(report, images, tmp_path):
    files = write_report(report, images, tmp_path)
    raw = json.loads(files.json.read_text(), parse_constant=lambda token: pytest.fail(f"bare {token} in JSON"))
    assert raw["schema_version"] == 1 and raw["passed"] is False
    assert raw["created_at"] == "2026-01-02T03:04:05Z"
    assert raw["variants"][0]["images"][0]["psnr_db"] == "Infinity"
    assert raw["variants"][0]["images"][0]["diff_png"] == "ort-fp32/seed0.diff.png"
    loaded = read_report(files.json)
    assert loaded.variants[0].images[0].psnr_db == math.inf
    assert loaded.variants[1].images[0].psnr_db == pytest.approx(report.variants[1].images[0].psnr_db)
    assert [v.passed for v in loaded.variants] == [True, False]


def test_json_validates_against_the_written_schema(report, images, tmp_path):
    files = write_report(report, images, tmp_path)
    schema = json.loads(files.schema.read_text())
    assert schema == ParityReport.model_json_schema()
    instance = json.loads(files.json.read_text())
    assert schema_errors(instance, schema) == []
    # The checker can fail: an unknown field and a wrongly typed metric are both caught.
    instance["variants"][0]["images"][0]["psnr_db"] = "very high"
    instance["variants"][1]["colour"] = "red"
    errors = schema_errors(instance, schema)
    assert any("psnr_db" in error for error in errors) and any("unexpected colour" in error for error in errors)


def test_html_has_one_summary_row_per_variant_and_working_images(report, images, tmp_path):
    files = write_report(report, images, tmp_path)
    page = parse_page(files.html.read_text())
    rows = page.summary_rows
    assert [row[0][0] for row in rows] == ["sd15-tiny.onnxruntime.fp32", "sd15-tiny.tensorrt.fp8"]
    assert [(row[-1][0], row[-1][1]) for row in rows] == [("PASS", "pass"), ("FAIL", "fail")]
    assert rows[0][4][0] == "∞ dB" and rows[0][5][0] == "1.0000" and rows[0][6][0] == "n/a"
    assert len(page.images) == 6  # reference | candidate | diff for each of the two variants
    for src in page.images:
        assert (tmp_path / unquote(src)).is_file(), src


def test_html_escapes_text(report, images, tmp_path):
    text = write_report(report, images, tmp_path).html.read_text()
    assert "script" not in parse_page(text).tags
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; a cat" in text  # markupsafe's escapes


def test_failed_variant_lists_its_reasons_in_html(report, images, tmp_path):
    text = write_report(report, images, tmp_path).html.read_text()
    assert '<h1>Parity report: <span class="fail">FAIL</span></h1>' in text
    assert '<ul class="failures"><li>image 0 (seed 0, ' in text


def test_write_report_requires_every_referenced_image(report, images, tmp_path):
    del images["trt-fp8/seed0.png"]
    with pytest.raises(ValueError, match="not given: trt-fp8/seed0.png"):
        write_report(report, images, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_write_report_rejects_non_uint8_images(report, images, tmp_path):
    images["trt-fp8/seed0.png"] = images["trt-fp8/seed0.png"].astype(np.float32)
    with pytest.raises(ValueError, match="expected uint8 pixels, got float32"):
        write_report(report, images, tmp_path)


def test_interrupted_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "parity.json"
    target.write_text("old")

    def fail_replace(source, destination):
        raise OSError("disk full")

    monkeypatch.setattr(report_files.os, "replace", fail_replace)
    with pytest.raises(OSError, match="disk full"):
        report_files._write_atomically(target, b"new")
    assert target.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["parity.json"]


def test_diff_heatmap():
    reference = np.zeros((2, 3, 3), dtype=np.uint8)
    candidate = reference.copy()
    candidate[0, 0, 1] = 32  # 32 * gain 8 / 255 > 1: full scale
    candidate[1, 2, 2] = 1
    heatmap = diff_heatmap(reference, candidate)
    assert heatmap.shape == (2, 3, 3) and heatmap.dtype == np.uint8
    assert heatmap[0, 0].tolist() == [252, 255, 164]
    assert heatmap[0, 1].tolist() == [0, 0, 4]  # unchanged pixel: the ramp's dark end
    assert heatmap[1, 2].tolist() not in ([0, 0, 4], [252, 255, 164])  # small diff, visible but not saturated
    with pytest.raises(ValueError, match="shape mismatch"):
        diff_heatmap(reference, candidate[:1])


# --- terminal --------------------------------------------------------------------------------


def _rendered(table) -> str:
    console = Console(record=True, width=200, color_system=None)
    console.print(table)
    return console.export_text()


def test_render_summary_one_row_per_variant(report):
    table = render_summary(report)
    assert table.row_count == 2
    text = _rendered(table)
    assert "Parity: FAIL (2 variants)" in text
    good_line = next(line for line in text.splitlines() if "onnxruntime.fp32" in line)
    bad_line = next(line for line in text.splitlines() if "tensorrt.fp8" in line)
    assert "PASS" in good_line and "∞ dB" in good_line
    assert "FAIL" in bad_line and "image 0 (seed 0" in bad_line
    assert [cell.style for cell in table.columns[7].cells] == ["green", "bold red"]


def test_render_summary_shows_ids_literally():
    thresholds = Thresholds(min_psnr_db=1, min_ssim=0)
    comparison = ImageComparison(
        prompt="p", seed=0, psnr_db=50.0, ssim=1.0, lpips=0.01, passed=True,
        reference_png="r.png", candidate_png="c.png",
    )
    variant = judge_variant(
        variant_id="[bold]odd[/bold]", model="m", target="t", precision="fp32", bucket="b",
        thresholds=thresholds, images=[comparison],
    )
    text = _rendered(render_summary(judge_report([variant], tool_versions={})))
    assert "[bold]odd[/bold]" in text and "Parity: PASS (1 variants)" in text and "0.0100" in text
