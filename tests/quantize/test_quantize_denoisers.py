"""FP8 and INT8 PTQ of the tiny SD1.5 / SDXL UNets and the SD3 transformer into Q/DQ ONNX that ONNX
Runtime runs on CPU, with the declared engine inputs, the selected layers quantized and no others."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from trt_diffusion.components import Geometry
from trt_diffusion.engines_file import Size
from trt_diffusion.lora.onnx_graph import graph_consumers
from trt_diffusion.metrics import psnr
from trt_diffusion.models.loading import load_component
from trt_diffusion.quantize import ptq
from trt_diffusion.quantize.defaults import DENOISER_MIN_PSNR_DB
from trt_diffusion.quantize.feeds import denoiser_interface
from trt_diffusion.quantize.gate import GateThresholds
from trt_diffusion.quantize.stage import quantize_component

from .conftest import DENOISER, TINY_BUCKET

# sd15 in the default run; the sdxl and sd3 cases (about 40 s together) in the slow suite
CASES = [(family, precision) if family == "sd15" else pytest.param(family, precision, marks=pytest.mark.slow)
         for family in ("sd15", "sdxl", "sd3") for precision in ("int8", "fp8")]


@pytest.mark.parametrize("family,precision", CASES)
def test_qdq_onnx_runs_in_onnxruntime_with_the_declared_inputs(quantized_matrix, family, precision):
    model, artifact = quantized_matrix(family, precision)
    interface = denoiser_interface(model, DENOISER[family])
    session = ort.InferenceSession(str(artifact.onnx_path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == interface.input_names
    assert [o.name for o in session.get_outputs()] == ["noise_pred"]

    # another batch and resolution than calibration: the declared dynamic axes hold
    width, height = (int(side) * 2 for side in TINY_BUCKET[family].split("x"))
    feeds = interface.definition.dummy_inputs(interface.config, interface.options, Geometry(3, Size(width, height)))
    output = session.run(None, feeds)[0]
    assert output.shape[0] == 3 and np.isfinite(output).all()

    # The gate applied the precision's own bars (not whatever the artifact carries) and passed them.
    gate = artifact.gate
    assert gate["thresholds"] == GateThresholds.for_precision(precision).to_json()
    assert gate["thresholds"]["min_output_psnr_db"] == DENOISER_MIN_PSNR_DB[precision]
    assert gate["passed"] and not gate["failures"] and gate["output_nonfinite"] == 0

    # And measured again here, outside the gate's code: the Q/DQ ONNX against the fp32 torch module on inputs
    # the gate never saw (another seed, the calibration's bucket), PSNR with the reference's range as peak.
    width, height = (int(side) for side in TINY_BUCKET[family].split("x"))
    feeds = interface.definition.dummy_inputs(interface.config, interface.options, Geometry(2, Size(width, height)),
                                              seed=123)
    module = load_component(model.source.path, DENOISER[family])
    with torch.no_grad():
        expected = interface.wrapper(module)(*[torch.from_numpy(feeds[n]) for n in interface.input_names]).numpy()
    actual = session.run(None, feeds)[0]
    measured = psnr(expected, actual, data_range=float(expected.max() - expected.min()))
    assert measured >= DENOISER_MIN_PSNR_DB[precision], measured


@pytest.mark.parametrize("family,precision", CASES)
def test_exactly_the_selected_layers_are_quantized(quantized_matrix, family, precision):
    model, artifact = quantized_matrix(family, precision)
    quantized, excluded = artifact.manifest["quantized_layers"], artifact.manifest["excluded_layers"]
    assert quantized and excluded

    # ONNX: weight and input Q/DQ per quantized layer (fp8 weights are stored as fp8 behind a DQ only)
    graph = onnx.load(str(artifact.onnx_path)).graph
    ops = [n.op_type for n in graph.node]
    if precision == "int8":
        assert ops.count("QuantizeLinear") == ops.count("DequantizeLinear") == 2 * len(quantized)
    else:
        assert ops.count("QuantizeLinear") == len(quantized)
        assert ops.count("DequantizeLinear") == 2 * len(quantized)
        fp8 = [t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN]
        assert len(fp8) == len(quantized) + 1  # every quantized weight, plus the shared zero point

    # convolution weights keep their names: excluded ones feed the Conv directly, quantized ones go through Q/DQ
    consumers = graph_consumers(graph)
    conv_layers = [n for n in (*quantized, *excluded) if f"{n}.weight" in consumers or f"{n}.weight_fp8" in consumers]
    for layer in conv_layers:
        if layer in excluded:
            assert {c.op_type for c in consumers[f"{layer}.weight"]} <= {"Conv", "Gemm", "MatMul", "Transpose"}, layer
        elif precision == "int8":
            assert [c.op_type for c in consumers[f"{layer}.weight"]] == ["QuantizeLinear"], layer
        else:
            assert [c.op_type for c in consumers[f"{layer}.weight_fp8"]] == ["DequantizeLinear"], layer

    # torch: the saved state, put back on a fresh module, has quantizers on exactly the selected layers
    module = load_component(model.source.path, DENOISER[family])
    ptq.restore_state(module, artifact.state_path)
    assert sorted(ptq.quantized_layers(module)) == sorted(quantized)
    enabled = set(ptq.enabled_quantizers(module))
    for layer in excluded:
        assert f"{layer}.weight_quantizer" not in enabled and f"{layer}.input_quantizer" not in enabled


def test_a_committed_artifact_is_reused(quantized_matrix):
    model, artifact = quantized_matrix("sd15", "int8")
    again = quantize_component(model, "unet", "int8", None, artifact.path.parent.parent, held_out_samples=1)
    assert again.cached and again.path == artifact.path


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_the_onnxruntime_engine_computes_what_its_qdq_graph_computes(quantized_matrix, precision, tmp_path):
    """The onnxruntime target's fixed-shape, offline-optimized engine of a Q/DQ graph against the graph itself run
    with its dynamic shapes and no optimization: the same function. An fp8 engine lost 16 dB here (on the
    micro-model's UNet) to ONNX Runtime's Q/DQ propagation over fixed shapes (targets/onnxruntime/engine.py)."""
    from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec
    from trt_diffusion.targets.onnxruntime.engine import build_engine
    from trt_diffusion.targets.onnxruntime.runner import load_runner

    model, artifact = quantized_matrix("sd15", precision)
    interface = denoiser_interface(model, "unet")
    width, height = (int(side) for side in TINY_BUCKET["sd15"].split("x"))
    feeds = interface.definition.dummy_inputs(interface.config, interface.options, Geometry(2, Size(width, height)),
                                              seed=7)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    graph = ort.InferenceSession(str(artifact.onnx_path), options, providers=["CPUExecutionProvider"])
    expected = graph.run(None, feeds)[0]
    spec = EngineSpec(model="m", family="sd15", source="local:test", component="unet", target="onnxruntime",
                      precision=precision, batch=2, bucket=Bucket.static(Size(width, height)))
    folder, _, _ = build_engine(artifact.onnx_path, spec, {n: (v.shape,) * 3 for n, v in feeds.items()}, tmp_path)
    actual = load_runner(folder).run(feeds)["noise_pred"]
    measured = psnr(expected, actual, data_range=float(expected.max() - expected.min()))
    assert measured >= 60, measured  # float re-association only: the same Q/DQ points, the same rounding
