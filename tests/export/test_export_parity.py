"""Every component kind exports and matches PyTorch under ONNX Runtime at two or more shapes."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from trt_diffusion import api
from trt_diffusion.components import Geometry, get_component, load_model_config
from trt_diffusion.engines_file import Size, expand, load_engines_file
from trt_diffusion.errors import ExportError
from trt_diffusion.export import check_parity
from trt_diffusion.families import Component
from trt_diffusion.models.loading import load_component


def _io_dims(onnx_path) -> dict[str, list]:
    model = onnx.load(str(onnx_path), load_external_data=False)
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (*model.graph.input, *model.graph.output)}


def _assert_verified(result) -> None:
    checks = result.parity
    assert checks and all(c["passed"] for c in checks), checks
    assert len({c["geometry"] for c in checks}) >= 2, "parity must run at two or more shapes"
    assert result.onnx_path.is_file() and (result.onnx_path.parent / "model.onnx.data").is_file()


def test_sd15_components_export_and_match_pytorch(sd15_export):
    results = sd15_export.report.results
    assert [r.group.name for r in results] == [
        "sd15-tiny.text_encoder.fp16", "sd15-tiny.unet+residuals.fp32", "sd15-tiny.vae_encoder.fp32",
        "sd15-tiny.vae_decoder.fp32", "sd15-tiny.controlnet.canny.fp32"]
    for result in results:
        _assert_verified(result)
        assert not result.cached
    unet = sd15_export.result("unet")
    dims = _io_dims(unet.onnx_path)
    assert {k: dims[k] for k in ("sample", "timestep", "encoder_hidden_states", "noise_pred")} == {
        "sample": ["batch", 4, "height", "width"], "timestep": ["batch"],
        "encoder_hidden_states": ["batch", 77, 32], "noise_pred": ["batch", 4, "height", "width"]}
    assert dims["mid_block_residual"] == ["batch", 16, "height_div2", "width_div2"]
    assert unet.dynamic_ranges == {"batch": [2, 3], "height": [8, 16], "width": [8, 16], "height_div2": [4, 8],
                                   "width_div2": [4, 8]}
    decoder = _io_dims(sd15_export.result("vae_decoder").onnx_path)
    assert decoder["images"] == ["batch", 3, "image_height", "image_width"]
    text = _io_dims(sd15_export.result("text_encoder").onnx_path)
    assert text == {"input_ids": ["batch", 77], "hidden_states": ["batch", 77, 32], "pooled": ["batch", 32]}
    images = [c for c in sd15_export.result("vae_decoder").parity if c["output"] == "images"]
    assert all(c["psnr_db"] is None or c["psnr_db"] > 60 for c in images)


def test_controlnet_outputs_are_the_unet_residual_inputs(sd15_export):
    unet, controlnet = sd15_export.result("unet"), sd15_export.result("controlnet")
    controlnet_outputs = controlnet.artifact.manifest["io"]["outputs"]
    residual_inputs = [t for t in unet.artifact.manifest["io"]["inputs"] if "residual" in t["name"]]
    assert residual_inputs == controlnet_outputs
    names = [t["name"] for t in controlnet_outputs]
    assert names == [f"down_block_residual_{i}" for i in range(4)] + ["mid_block_residual"]  # conv_in, 2 resnets, 1 downsampler
    assert _io_dims(controlnet.onnx_path)["controlnet_cond"] == ["batch", 3, "image_height", "image_width"]


def test_one_onnx_serves_every_target_bucket_and_batch(sd15_export):
    specs = expand(load_engines_file(sd15_export.config))
    unet_specs = [s for s in specs if s.component == "unet"]
    assert {s.target for s in unet_specs} == {"tensorrt", "onnxruntime"} and len(unet_specs) == 4
    assert {sd15_export.report.artifact_for(s) for s in unet_specs} == {sd15_export.result("unet").onnx_path}
    assert set(sd15_export.report.by_spec) == {s.key for s in specs}


def test_initializers_keep_the_torch_parameter_names(sd15_export, tiny_model_dir):
    for component, prefixes in (("unet", ("",)), ("vae_decoder", ("decoder.", "post_quant_conv."))):
        module = load_component(tiny_model_dir("sd15", controlnet=True), Component(component))
        expected = {n for n, _ in module.named_parameters() if n.startswith(prefixes)}
        model = onnx.load(str(sd15_export.result(component).onnx_path), load_external_data=False)
        names = {init.name for init in model.graph.initializer}
        assert expected and expected <= names, sorted(expected - names)[:5]
    fp16 = onnx.load(str(sd15_export.result("text_encoder").onnx_path), load_external_data=False)
    weights = [i for i in fp16.graph.initializer if i.name.endswith("q_proj.weight")]
    assert weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in weights)


def test_a_corrupted_weight_fails_the_parity_check(sd15_export, tiny_model_dir, tmp_path):
    unet = sd15_export.result("unet")
    folder = tiny_model_dir("sd15", controlnet=True)
    definition = get_component("sd15", "unet")
    config = load_model_config(folder, "sd15", "unet")
    options = {"controlnet_residuals": True}
    reference = definition.wrapper(load_component(folder, Component.unet), config, options)
    geometries = [Geometry(2, Size(64, 64)), Geometry(3, Size(128, 128))]

    intact = tmp_path / "intact"
    shutil.copytree(unet.onnx_path.parent, intact)
    check_parity(intact / "model.onnx", reference, definition, config, options, geometries, "fp32", "intact")

    model = onnx.load(str(intact / "model.onnx"))
    weight = next(init for init in model.graph.initializer if init.name == "conv_out.weight")
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) + 0.05, weight.name))
    corrupted = tmp_path / "corrupted"
    corrupted.mkdir()
    onnx.save_model(model, str(corrupted / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    message = r"output 'noise_pred' at batch 2, 64x64 \(shape \[2, 4, 8, 8\]\): max abs error"
    with pytest.raises(ExportError, match=message):
        check_parity(corrupted / "model.onnx", reference, definition, config, options, geometries, "fp32", "corrupted")


@pytest.mark.slow  # two exports of the UNet (~17 s); fused variants are also built in tests/quantize
def test_fused_lora_variant_is_its_own_verified_export(tmp_path, tiny_model_dir, write_engines_yaml):
    model = tiny_model_dir("sd3", lora=True)
    lora = {"style": {"source": str(model / "lora" / "pytorch_lora_weights.safetensors"), "mode": "fused",
                      "scale": 0.8}}
    config = write_engines_yaml(tmp_path, model, "sd3", components=["text_encoder_3", "transformer"],
                                buckets=["64x64", "128x96"], precision={"text_encoder_3": "fp32", "transformer": "fp32"},
                                loras=lora)
    report = api.export(config)
    assert [r.group.name for r in report.results] == [
        "sd3-tiny.text_encoder_3.fp32", "sd3-tiny.transformer.fp32", "sd3-tiny.transformer.lora-style.fp32"]
    for result in report.results:
        _assert_verified(result)
    _, base, fused = report.results
    assert base.artifact.path != fused.artifact.path
    names = [sorted(i.name for i in onnx.load(str(r.onnx_path), load_external_data=False).graph.initializer)
             for r in (base, fused)]
    assert names[0] == names[1]  # same parameter names: refit maps apply to both
    definition = get_component("sd3", "transformer")
    model_config = load_model_config(model, "sd3", "transformer")
    feeds = definition.dummy_inputs(model_config, {}, Geometry(2, Size(64, 64)))
    outputs = [ort.InferenceSession(str(r.onnx_path)).run(None, feeds)[0] for r in (base, fused)]
    assert np.abs(outputs[0] - outputs[1]).max() > 1e-3  # the LoRA really is in the weights


FAMILY_COMPONENTS = [
    # the sdxl UNet (41 s here) and flux transformer (17 s) exports run in the slow suite; sd15 is exported by default
    pytest.param("sdxl", ["text_encoder", "text_encoder_2", "unet"], {}, marks=pytest.mark.slow),
    pytest.param("flux", ["transformer"], {"cfg": ["none"]}, marks=pytest.mark.slow),
    pytest.param("sdxl", ["unet", "vae_encoder", "vae_decoder"],  # fp16 UNet + ControlNet (SDXL's added conditions)
                 {"controlnets": "controlnet", "precision": {"unet": "fp16", "vae_encoder": "fp32", "vae_decoder": "fp32"}},
                 marks=pytest.mark.slow),
    pytest.param("sd3", ["text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder"], {}, marks=pytest.mark.slow),
    pytest.param("flux", ["text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder"], {}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family,components,extra", FAMILY_COMPONENTS)
def test_family_components_export_and_match_pytorch(tmp_path, tiny_model_dir, write_engines_yaml, family,
                                                     components, extra):
    model = tiny_model_dir(family, controlnet="controlnets" in extra)
    if "controlnets" in extra:
        extra = {**extra, "controlnets": {"canny": {"source": str(model / "controlnet")}}}
    extra = {"precision": {c: "fp32" for c in components}, **extra}
    config = write_engines_yaml(tmp_path, model, family, components=components, buckets=["64x64", "128x96"], **extra)
    report = api.export(config)
    expected = set(components) | ({"controlnet"} if "controlnets" in extra else set())
    assert {r.group.component for r in report.results} == expected
    for result in report.results:
        _assert_verified(result)
