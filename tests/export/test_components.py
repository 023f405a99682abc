"""Component declarations against the real tiny modules: names, shapes, profiles, grouping (no export)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trt_diffusion.components import Geometry, get_component, load_model_config, registered_components
from trt_diffusion.engines_file import Bucket, EngineSpec, Size
from trt_diffusion.errors import ConfigError, ExportError
from trt_diffusion.export import export_group_key, group_specs
from trt_diffusion.export.shapes import export_shapes
from trt_diffusion.families import FAMILIES, Component
from trt_diffusion.models.loading import load_component, load_controlnet

REGISTERED = [(f.value, c.value) for f, c in registered_components()]


def _tiny(tiny_model_dir, family: str, component: str):
    # only Wan 2.2's folders have a second expert; only Wan 2.1 I2V's an image encoder (Qwen-Image-Edit's: its
    # text encoder's vision tower)
    variant = {"transformer_2": "two_expert", "image_encoder": "i2v"}.get(component) if family == "wan" else None
    if family == "qwen_image" and component == "image_encoder":
        variant = "edit"
    folder = tiny_model_dir(family, controlnet=component == "controlnet", variant=variant)
    controlnet_dir = folder / "controlnet" if component == "controlnet" else None
    config = load_model_config(folder, family, component, controlnet_dir)
    module = load_controlnet(controlnet_dir) if controlnet_dir else load_component(folder, Component(component))
    return config, module


def test_every_family_component_is_registered():
    expected = {(f.value, c.value) for f, info in FAMILIES.items() for c in info.components}
    assert set(REGISTERED) == expected


@pytest.mark.parametrize("family,component", REGISTERED)
def test_registered_component_has_a_tiny_fixture_matching_its_declaration(tiny_model_dir, family, component):
    """Fails for a registered component without a tiny model, or whose declared shapes are wrong."""
    config, module = _tiny(tiny_model_dir, family, component)
    definition = get_component(family, component)
    options = {"controlnet_residuals": component == "unet"}
    io = definition.io(config, options)
    video = FAMILIES[definition.family].is_video
    geometry = Geometry(2, (Size(64, 32, 9) if video else Size(64, 32)) if definition.resolution_dependent else None)
    feeds = definition.dummy_inputs(config, options, geometry)
    assert list(feeds) == io.input_names
    assert {k: v.shape for k, v in feeds.items()} == definition.shapes(config, options, geometry)
    wrapper = definition.wrapper(module, config, options)
    assert not wrapper.training
    with torch.inference_mode():
        outputs = wrapper(*[torch.from_numpy(feeds[n]) for n in io.input_names])
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    values = definition.axis_values(config, geometry)
    if (family, component) == ("qwen_image", "image_encoder"):  # one embedding per 2x2 merged patch of its grid
        grid_h, grid_w, _ = feeds["patches"].shape
        values["tokens"] = grid_h * grid_w // 4
    assert [tuple(o.shape) for o in outputs] == [t.shape(values) for t in io.outputs]
    assert all(o.dtype == torch.float32 and torch.isfinite(o).all() for o in outputs)


def test_io_names_follow_the_runtime_contract(tiny_model_dir):
    names = {}
    for family, component in [("sd15", "text_encoder"), ("sdxl", "unet"), ("sd15", "controlnet"),
                              ("sd3", "transformer"), ("flux", "transformer"), ("sd3", "text_encoder_3"),
                              ("sd15", "vae_decoder"), ("sd15", "vae_encoder")]:
        config, _ = _tiny(tiny_model_dir, family, component)
        names[(family, component)] = get_component(family, component).io(config, {})
    assert names[("sd15", "text_encoder")].output_names == ["hidden_states", "pooled"]
    assert names[("sdxl", "unet")].input_names == ["sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"]
    controlnet = names[("sd15", "controlnet")]
    assert controlnet.input_names == ["sample", "timestep", "encoder_hidden_states", "controlnet_cond", "conditioning_scale"]
    assert controlnet.output_names[-1] == "mid_block_residual" and controlnet.output_names[0] == "down_block_residual_0"
    assert names[("sd3", "transformer")].input_names == ["hidden_states", "timestep", "encoder_hidden_states",
                                                         "pooled_projections"]
    assert names[("flux", "transformer")].input_names == ["hidden_states", "timestep", "guidance", "encoder_hidden_states",
                                                          "pooled_projections", "img_ids", "txt_ids"]
    assert names[("sd3", "text_encoder_3")].inputs[0].dim_names() == ("batch", 32)
    assert names[("sd15", "vae_decoder")].outputs[0].dim_names() == ("batch", 3, "image_height", "image_width")
    assert names[("sd15", "vae_encoder")].output_names == ["latent", "latent_std"]  # sampled on the host


def test_unet_residual_inputs_are_the_controlnet_outputs(tiny_model_dir):
    folder = tiny_model_dir("sdxl", controlnet=True)
    unet_config = load_model_config(folder, "sdxl", "unet")
    cn_config = load_model_config(folder, "sdxl", "controlnet", folder / "controlnet")
    unet_io = get_component("sdxl", "unet").io(unet_config, {"controlnet_residuals": True})
    cn_io = get_component("sdxl", "controlnet").io(cn_config, {})
    residual_inputs = [t for t in unet_io.inputs if "residual" in t.name]
    assert [(t.name, t.dim_names()) for t in residual_inputs] == [(t.name, t.dim_names()) for t in cn_io.outputs]


def _spec(component: str, bucket: Bucket | None, batch: int = 2, precision: str = "fp32", target: str = "onnxruntime",
          **extra) -> EngineSpec:
    return EngineSpec(model="m", family="sd15", source="local:x", component=component, target=target,
                      precision=precision, batch=batch, bucket=bucket, build_options=(("opset", 20),), **extra)


def test_profile_is_the_bucket_range_at_the_engine_batch(tiny_model_dir):
    config = load_model_config(tiny_model_dir("sd15"), "sd15", "unet")
    bucket = Bucket(Size(64, 64), Size(96, 64), Size(128, 128))
    profile = get_component("sd15", "unet").profile(_spec("unet", bucket), config)
    assert profile["sample"] == ((2, 4, 8, 8), (2, 4, 8, 12), (2, 4, 16, 16))
    assert profile["timestep"] == ((2,), (2,), (2,))
    assert profile["encoder_hidden_states"] == ((2, 77, 32),) * 3
    text = get_component("sd15", "text_encoder").profile(
        _spec("text_encoder", None), load_model_config(tiny_model_dir("sd15"), "sd15", "text_encoder"))
    assert text == {"input_ids": ((2, 77),) * 3}


def test_flux_profile_counts_packed_tokens(tiny_model_dir):
    config = load_model_config(tiny_model_dir("flux"), "flux", "transformer")
    bucket = Bucket(Size(64, 64), Size(64, 64), Size(128, 96))
    profile = get_component("flux", "transformer").profile(_spec("transformer", bucket, batch=1), config)
    assert profile["hidden_states"] == ((1, 16, 16), (1, 16, 16), (1, 48, 16))  # (h/2)*(w/2) tokens of C*4
    assert profile["img_ids"] == ((16, 3), (16, 3), (48, 3))
    assert profile["txt_ids"] == ((32, 3),) * 3


def test_group_key_ignores_target_bucket_and_batch_but_not_precision():
    a = _spec("unet", Bucket.static(Size(64, 64)), batch=2, target="tensorrt")
    b = _spec("unet", Bucket.static(Size(128, 128)), batch=4, target="onnxruntime")
    assert export_group_key(a) == export_group_key(b)
    assert export_group_key(_spec("unet", None, precision="fp16")) != export_group_key(a)
    assert export_group_key(_spec("unet", None, precision="int8")) == export_group_key(a)  # quantize starts from fp32
    assert export_group_key(_spec("unet", None, controlnet="x")) != export_group_key(a)
    assert len(group_specs([a, b])) == 1


def test_export_shapes_cover_every_bucket_and_widen_a_single_shape(tiny_model_dir):
    config = load_model_config(tiny_model_dir("sd15"), "sd15", "unet")
    definition = get_component("sd15", "unet")
    (group,) = group_specs([_spec("unet", Bucket.static(Size(64, 64)), batch=2),
                            _spec("unet", Bucket(Size(64, 64), Size(96, 96), Size(128, 96)), batch=4)])
    shapes = export_shapes(group, definition, config)
    assert shapes.ranges["batch"] == (2, 4) and shapes.ranges["height"] == (8, 12) and shapes.ranges["width"] == (8, 16)
    assert len(shapes.parity) == 3
    (single,) = group_specs([_spec("unet", Bucket.static(Size(64, 64)), batch=1)])
    widened = export_shapes(single, definition, config)
    assert widened.ranges["batch"] == (1, 2) and widened.ranges["height"] == (8, 10)
    assert len(set(widened.parity)) >= 2


def test_misaligned_bucket_is_an_export_error(tiny_model_dir):
    config = load_model_config(tiny_model_dir("sd15"), "sd15", "unet")
    (group,) = group_specs([_spec("unet", Bucket.static(Size(72, 64)))])
    with pytest.raises(ExportError, match="72x64 are not multiples of 16 pixels"):
        export_shapes(group, get_component("sd15", "unet"), config)


def test_family_without_the_component_is_a_config_error():
    with pytest.raises(ConfigError, match="the sd15 family has no transformer"):
        get_component("sd15", "transformer")


def test_dummy_inputs_are_seeded():
    definition = get_component("sd15", "vae_decoder")
    from trt_diffusion.components.model_config import ModelConfig

    config = ModelConfig({"out_channels": 3}, vae_scale_factor=8, latent_channels=4, sequence_length=None)
    geometry = Geometry(1, Size(64, 64))
    first, second = (definition.dummy_inputs(config, {}, geometry, seed=3) for _ in range(2))
    np.testing.assert_array_equal(first["latent"], second["latent"])
    assert not np.array_equal(first["latent"], definition.dummy_inputs(config, {}, geometry, seed=4)["latent"])
