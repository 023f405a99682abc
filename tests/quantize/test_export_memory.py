"""The Q/DQ export never holds a quantized model twice: the trace lets go of the module before the graph is
read back, and weights the exporter wrote out are streamed into the artifact's one data file, not loaded."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import numpy as np
import onnx
import pytest
import torch
from onnx.external_data_helper import convert_model_to_external_data, uses_external_data

from trt_diffusion.quantize import ptq
from trt_diffusion.quantize.calibration import CalibrationRecipe, capture_calls, denoiser_of, load_pipeline
from trt_diffusion.quantize.exclusions import select_layers
from trt_diffusion.quantize.feeds import as_numpy, denoiser_interface
from trt_diffusion.quantize.gate import onnxruntime_session, release_weights
from trt_diffusion.quantize.onnx_export import TracedGraph, export_opset, finalize_quantized, traced_quantized
from trt_diffusion.quantize.prompts import load_prompts, take

from .conftest import model_entry, resolved

RECIPE = CalibrationRecipe(prompts=tuple(take(load_prompts(None)[0], 1)), steps=1, seed=0, algorithm="max",
                           width=64, height=64)


def _calibrated(model_dir, write_config, precision: str):
    """(pipeline with a calibrated UNet, its interface, example feeds); not a fixture, which pytest would
    keep alive for the whole test."""
    model = resolved(write_config({"m": model_entry(model_dir, "sd15", precision)}), "m")
    pipe = load_pipeline(model_dir)
    calls = capture_calls(pipe, model.family, RECIPE)
    module = denoiser_of(pipe)
    ptq.calibrate(module, precision, "max", select_layers(module), ptq.replay(calls))
    interface = denoiser_interface(model, "unet")
    return pipe, interface, interface.feeds(calls[0])


def _outputs(path, interface, feeds) -> np.ndarray:
    return onnxruntime_session(path).run([interface.output_name], as_numpy(feeds))[0]


@pytest.mark.slow  # a quantized export traced to a folder (about 8 s each)
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_the_trace_lets_go_of_the_module_and_streams_external_weights(tiny_model_factory, write_config, tmp_path,
                                                                      precision):
    pipe, interface, feeds = _calibrated(tiny_model_factory("sd15"), write_config, precision)
    opset = export_opset(17, precision)
    module = weakref.ref(denoiser_of(pipe))
    with traced_quantized(denoiser_of(pipe), interface, feeds, precision, opset) as traced:
        del pipe
        gc.collect()
        assert module() is None  # nothing of the trace (the generator's frame included) keeps the module
        inline = finalize_quantized(traced, interface, tmp_path / "inline" / "model.onnx", precision)

        # What the legacy exporter writes above 2 GB: one file per tensor beside the graph.
        raw = onnx.load(str(traced.path))
        convert_model_to_external_data(raw, all_tensors_to_one_file=False, size_threshold=0, convert_attribute=True)
        onnx.save_model(raw, str(traced.path))
        raw = onnx.load(str(traced.path), load_external_data=False)
        constants = [n.attribute[0].t for n in raw.graph.node if n.op_type == "Constant" and n.attribute[0].t.dims]
        assert any(uses_external_data(t) for t in constants)  # Constant values too, as the exporter writes them
        for tensor in [*raw.graph.initializer, *constants]:  # and with no length: each file is the whole tensor
            kept = [e for e in tensor.external_data if e.key not in ("length", "offset")]
            del tensor.external_data[:]
            tensor.external_data.extend(kept)
        onnx.save_model(raw, str(traced.path))
        split = TracedGraph(traced.path, traced.conv_weight_amax)
        # the FP8 rewrite reads each weight it converts from those files
        streamed = finalize_quantized(split, interface, tmp_path / "streamed" / "model.onnx", precision)
        files = sorted(p.name for p in traced.path.parent.iterdir())
        assert len(files) > 10  # the per-tensor files
    assert not traced.path.parent.exists()  # the raw export is removed on leaving

    assert inline == streamed and inline.op_counts["QuantizeLinear"] > 0
    assert not (tmp_path / "inline" / "model.onnx.data").exists()
    graph = onnx.load(str(tmp_path / "streamed" / "model.onnx"), load_external_data=False).graph
    external = [t for t in graph.initializer if uses_external_data(t)]
    assert external and {e.value for t in external for e in t.external_data if e.key == "location"} == {
        "model.onnx.data"}
    names = {t.name for t in graph.initializer}  # the wrapper's prefix is gone; fp8 weights get a suffix
    assert {"down_blocks.0.resnets.0.conv1.weight", "down_blocks.0.resnets.0.conv1.weight_fp8"} & names
    assert not [n for n in names if n.startswith("model.")]
    np.testing.assert_array_equal(_outputs(tmp_path / "inline" / "model.onnx", interface, feeds),
                                  _outputs(tmp_path / "streamed" / "model.onnx", interface, feeds))


@pytest.mark.slow  # a fresh interpreter importing torch and modelopt: ~10 s
def test_a_calibrated_module_is_freed_once_its_callers_return():
    """In a fresh interpreter (modelopt not imported yet): pulp, which modelopt imports, keeps tracebacks of
    its import-time probes; imported from the stage's frames they would keep the UNet alive for good."""
    code = (
        "import gc, weakref, torch\n"
        "from trt_diffusion.quantize import ptq\n"
        "from trt_diffusion.quantize.exclusions import select_layers\n"
        "def calibrated():\n"
        "    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))\n"
        "    ptq.calibrate(module, 'int8', 'max', select_layers(module), lambda m: m(torch.randn(2, 8)))\n"
        "    assert ptq.quantized_layers(module)\n"
        "    return weakref.ref(module)\n"
        "ref = calibrated()\n"
        "gc.collect()\n"
        "print('alive' if ref() is not None else 'freed')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "freed"


def test_released_weights_keep_what_the_pipeline_reads(tiny_model_factory):
    module = denoiser_of(load_pipeline(tiny_model_factory("sd15")))
    config, dtype, device = dict(module.config), module.dtype, module.device
    release_weights(module)
    assert sum(p.numel() for p in module.parameters()) == 0
    assert sum(b.numel() for b in module.buffers()) == 0
    assert (dict(module.config), module.dtype, module.device) == (config, dtype, device)
    with pytest.raises(RuntimeError):  # a released module cannot silently compute with missing weights
        module(torch.zeros(1, 4, 8, 8), torch.tensor([1.0]), torch.zeros(1, 77, 32))
