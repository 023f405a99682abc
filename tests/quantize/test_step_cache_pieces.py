"""The Q/DQ graphs of a step cache's pieces of a quantized denoiser (quantize/pieces.py; DeepCache's on sd15,
first-block caching's on FLUX): exported from the denoiser's one calibration (restored, not redone: the calibration
store holds one state), every quantized layer they run carrying exactly the denoiser graph's quantizer scales
(weight and input), run by ONNX Runtime with the declared inputs, and gated output by output against the fp32 piece.

Before the change quantize_component took no piece (and engines.yaml refused a cache on an int8 UNet)."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from trt_diffusion.components import Geometry
from trt_diffusion.engines_file import Size
from trt_diffusion.errors import QuantizeError
from trt_diffusion.quantize.defaults import DENOISER_MIN_PSNR_DB
from trt_diffusion.quantize.feeds import denoiser_interface
from trt_diffusion.quantize.stage import CALIBRATION_KIND, quantize_component

from .conftest import DENOISER, TINY_BUCKET, model_entry, resolved

CACHES = {"sd15": {"method": "deepcache", "interval": 3, "branch": 0},
          "flux": {"method": "first_block", "threshold": 0.3}}
PIECES = {"sd15": ("unet_shallow", "unet_deep"), "flux": ("first_block", "rest_blocks")}
# sd15's int8 shallow graph in the default run (a small graph on a restored calibration); the rest in the slow suite
CASES = [pytest.param(family, precision, piece,
                      marks=() if (family, precision, piece) == ("sd15", "int8", "unet_shallow") else pytest.mark.slow)
         for family, precisions in (("sd15", ("int8", "fp8")), ("flux", ("int8",)))
         for precision in precisions for piece in PIECES[family]]


def layer_scales(onnx_path) -> dict[str, tuple[bytes, ...]]:
    """Each quantized Conv/MatMul/Gemm, keyed by its weight's bytes (the same module's layer in any graph), with
    the scales of the Q/DQ pairs in front of its inputs: what a quantizer state becomes in the graph."""
    model = onnx.load(str(onnx_path))
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producer = {out: node for node in model.graph.node for out in node.output}
    for node in model.graph.node:
        if node.op_type == "Constant":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)

    def dequantized(name):
        node = producer.get(name)
        while node is not None and node.op_type in ("Transpose", "Reshape", "Cast", "Identity"):
            node = producer.get(node.input[0])
        return node if node is not None and node.op_type == "DequantizeLinear" else None

    layers = {}
    for node in model.graph.node:
        if node.op_type not in ("Conv", "MatMul", "Gemm"):
            continue
        pairs = [dequantized(name) for name in node.input[:2]]
        if not all(pairs):
            continue
        weight_source = pairs[1].input[0]
        quantize = producer.get(weight_source)
        weight = values.get(quantize.input[0] if quantize is not None else weight_source)
        if weight is None:
            continue
        key = hashlib.sha256(np.ascontiguousarray(weight).tobytes()).hexdigest()
        layers[key] = tuple(np.asarray(values[dq.input[1]]).tobytes() for dq in pairs)
    return layers


@pytest.fixture(scope="session")
def cached_unet_pieces(quantized_matrix, tiny_model_factory, tmp_path_factory):
    """`cached_unet_pieces(family, precision, piece) -> (model, piece artifact, the denoiser's artifact)`: the piece
    quantized in the denoiser artifact's own workspace, from a model that adds a step cache (same name, same
    calibration recipe)."""
    import yaml

    cache = {}

    def get(family: str, precision: str, piece: str):
        if (family, precision, piece) not in cache:
            _, whole = quantized_matrix(family, precision)
            workspace = whole.path.parent.parent
            config = tmp_path_factory.mktemp("cached") / "engines.yaml"
            config.write_text(yaml.safe_dump({"version": 1, "models": {"m": model_entry(
                tiny_model_factory(family), family, precision, step_cache=CACHES[family])}}))
            model = resolved(config, "m")
            artifact = quantize_component(model, DENOISER[family], precision, None, workspace, held_out_samples=1,
                                          piece=piece)
            cache[(family, precision, piece)] = (model, artifact, whole)
        return cache[(family, precision, piece)]

    return get


@pytest.mark.parametrize("family,precision,piece", CASES)
def test_a_piece_is_exported_from_the_denoisers_calibration_with_its_scales(cached_unet_pieces, family, precision,
                                                                             piece):
    model, artifact, whole = cached_unet_pieces(family, precision, piece)
    assert artifact.path.name.startswith(f"m.{piece}.{precision}.") and artifact.key != whole.key
    # one calibration: restored from the denoiser's state, nothing recalibrated, one state in the store
    assert not artifact.recalibrated
    assert artifact.manifest["calibration_artifact"] == whole.manifest["calibration_artifact"]
    workspace = whole.path.parent.parent
    assert len(list((workspace / CALIBRATION_KIND).glob(f"m.{DENOISER[family]}.{precision}.*"))) == 1
    # the same quantizer states: every quantized layer of the piece has the denoiser graph's weight and input scales
    piece_layers, whole_layers = layer_scales(artifact.onnx_path), layer_scales(whole.onnx_path)
    assert piece_layers and set(piece_layers) <= set(whole_layers)
    assert all(piece_layers[key] == whole_layers[key] for key in piece_layers)
    if piece == "unet_deep":  # the whole UNet again, every layer quantized as in its graph
        assert set(piece_layers) == set(whole_layers)


@pytest.mark.parametrize("family,precision,piece", CASES)
def test_a_piece_runs_in_onnxruntime_and_passed_its_gate(cached_unet_pieces, family, precision, piece):
    model, artifact, _ = cached_unet_pieces(family, precision, piece)
    interface = denoiser_interface(model, DENOISER[family], piece)
    session = ort.InferenceSession(str(artifact.onnx_path), providers=["CPUExecutionProvider"])
    # the declared inputs, the unused one too (the tiny UNet's branch-0 shallow path has no cross-attention)
    assert [i.name for i in session.get_inputs()] == interface.input_names
    assert [o.name for o in session.get_outputs()] == interface.io.output_names
    # sd15's graphs at another batch and size; FLUX's Q/DQ graphs are static (docs/quantize.md#export)
    batch, size = (3, Size(128, 96)) if family == "sd15" else (1, Size(*map(int, TINY_BUCKET[family].split("x"))))
    feeds = interface.definition.dummy_inputs(interface.config, interface.options, Geometry(batch, size))
    outputs = session.run(None, feeds)
    assert outputs[0].shape[0] == batch and all(np.isfinite(o).all() for o in outputs)

    gate = artifact.gate
    assert gate["passed"] and not gate["failures"] and gate["output_nonfinite"] == 0
    assert set(gate["outputs"]) == set(interface.io.output_names)  # every output judged, the deep feature too
    assert min(gate["outputs"].values()) >= DENOISER_MIN_PSNR_DB[precision]


def test_a_piece_that_misses_its_bar_is_refused_and_nothing_is_committed(cached_unet_pieces):
    model, artifact, whole = cached_unet_pieces("sd15", "int8", "unet_shallow")
    workspace = whole.path.parent.parent
    before = sorted(p.name for p in (workspace / "quantized").iterdir())
    with pytest.raises(QuantizeError, match=r"(?s)m.unet_shallow.int8: quality gate failed.*unet_shallow \(noise_pred "
                                            r"[\d.]+ dB\): denoiser output PSNR [\d.]+ dB < 99 dB"):
        quantize_component(model, "unet", "int8", None, workspace, held_out_samples=1, piece="unet_shallow",
                           min_output_psnr_db=99.0)
    assert sorted(p.name for p in (workspace / "quantized").iterdir()) == before
