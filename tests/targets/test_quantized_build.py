"""int8 and fp8 entries through `build` and `parity`, as a user runs them: `build` exports, quantizes (seeded
calibration, the quality gate) and builds the engines from the Q/DQ artifacts; `parity` judges them against
the fp32 reference with the precision's thresholds. Slow: a calibration and a gate per precision."""

from __future__ import annotations

import json

import onnx
import pytest
import yaml

from trt_diffusion.cli import main
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.runtime.loader import built_engines

pytestmark = pytest.mark.slow

PRECISIONS = ("int8", "fp8")


@pytest.fixture(scope="module")
def quantized_config(tmp_path_factory, tiny_model_factory):
    root = tmp_path_factory.mktemp("quantized-build")
    model_dir = tiny_model_factory("sd15")
    models = {f"sd15-{precision}": {
        "source": str(model_dir), "family": "sd15", "components": ["text_encoder", "unet", "vae_decoder"],
        "buckets": ["64x64"], "batch": [1], "targets": ["onnxruntime"],
        "precision": {"text_encoder": "fp32", "unet": precision, "vae_decoder": "fp32"},
        "quantization": {"calibration": {"samples": 2, "steps": 2, "seed": 0}},
    } for precision in PRECISIONS}
    path = root / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build"}, "models": models}))
    return path


@pytest.fixture(scope="module")
def build_code(quantized_config):
    return main(["build", str(quantized_config)])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_build_makes_the_unet_engine_from_the_qdq_artifact(quantized_config, build_code, precision):
    assert build_code == 0
    config = load_engines_file(quantized_config)
    engines = {e.spec.component: e for e in built_engines(config, f"sd15-{precision}", "onnxruntime")}
    assert set(engines) == {"text_encoder", "unet", "vae_decoder"}
    assert engines["unet"].spec.precision == precision
    ops = [n.op_type for n in onnx.load(str(engines["unet"].path / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count("QuantizeLinear") > 0 and ops.count("DequantizeLinear") > 0  # not the fp32 export
    for component in ("text_encoder", "vae_decoder"):
        model = onnx.load(str(engines[component].path / "model.onnx"), load_external_data=False)
        assert not [n for n in model.graph.node if n.op_type == "QuantizeLinear"], component


def test_parity_judges_the_quantized_variants_with_their_thresholds(quantized_config, build_code, tmp_path):
    assert build_code == 0
    out = tmp_path / "parity"
    assert main(["parity", str(quantized_config), "--steps", "2", "--out", str(out)]) == 0
    report = json.loads((out / "parity.json").read_text())
    by_precision = {v["precision"]: v for v in report["variants"]}
    assert set(by_precision) == set(PRECISIONS) and report["passed"] is True
    for precision, variant in by_precision.items():
        assert variant["passed"] is True, variant.get("failures")
        # judged against the precision's bar, and the engines really differ from fp32 (rounding shows)
        assert all(image["psnr_db"] != "Infinity" for image in variant["images"])
