"""Wan (video) export: frames as a dynamic axis of the transformer, the whole-clip VAE decoder exported per frame
count, 5-D profiles, and (slow) every wan component exported and verified against PyTorch, a dynamic frames axis
that the exporter freezes refused."""

from __future__ import annotations

import dataclasses

import onnx
import pytest

from trt_diffusion import api
from trt_diffusion.components import Geometry, get_component, load_model_config
from trt_diffusion.engines_file import Bucket, EngineSpec, Size
from trt_diffusion.errors import ExportError
from trt_diffusion.export import group_specs
from trt_diffusion.export.shapes import export_shapes
from trt_diffusion.families import WAN_TEXT_LENGTH


@pytest.fixture(scope="module")
def wan22(tiny_model_factory):
    return tiny_model_factory("wan", variant="two_expert")


def _spec(component: str, bucket: Bucket, batch: int = 1, target: str = "onnxruntime") -> EngineSpec:
    return EngineSpec(model="w", family="wan", source="local:x", component=component, target=target,
                      precision="fp32", batch=batch, bucket=bucket, build_options=(("opset", 20),))


def _static(text: str) -> Bucket:
    return Bucket.static(Size.parse(text))


def _io_dims(onnx_path) -> dict[str, list]:
    model = onnx.load(str(onnx_path), load_external_data=False)
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (*model.graph.input, *model.graph.output)}


def test_vae_graphs_are_one_per_frame_count_and_the_transformer_one_for_all():
    buckets = [_static("32x32x5"), _static("48x32x9"), _static("48x48x5")]
    groups = group_specs([_spec(c, b, target=t) for c in ("transformer", "vae_decoder") for b in buckets
                          for t in ("onnxruntime", "openvino")])
    assert [(g.name, len(g.specs)) for g in groups] == [
        ("w.transformer.fp32", 6), ("w.vae_decoder.5frames.fp32", 4), ("w.vae_decoder.9frames.fp32", 2)]
    assert groups[0].frames is None and groups[1].frames == (5,)


def test_transformer_frames_are_dynamic_and_widened_to_two_latent_frames(wan22):
    config = load_model_config(wan22, "wan", "transformer")
    definition = get_component("wan", "transformer")
    (group,) = group_specs([_spec("transformer", _static("32x32x5"), batch=2)])
    shapes = export_shapes(group, definition, config)
    assert shapes.ranges["frames"] == (2, 3)  # 5 frames = 2 latent frames, widened by one: really dynamic
    assert shapes.example == Geometry(3, Size(48, 48, 9)) and shapes.fixed == {}
    assert shapes.dim_ranges(definition.io(config, {}))["latent_frames"] == (2, 3)
    (ranged,) = group_specs([_spec("transformer", Bucket(Size(32, 32, 5), Size(32, 32, 9), Size(48, 32, 17)))])
    assert export_shapes(ranged, definition, config).ranges["frames"] == (2, 5)  # a frame range: one graph


def test_vae_decoder_is_exported_at_its_frame_count(wan22):
    config = load_model_config(wan22, "wan", "vae_decoder")
    definition = get_component("wan", "vae_decoder")
    (group,) = group_specs([_spec("vae_decoder", _static("32x32x9"))])
    shapes = export_shapes(group, definition, config)
    assert shapes.fixed == {"frames": 3} and shapes.ranges["frames"] == (3, 3)  # never widened
    io = shapes.graph_io(definition.io(config, {}))
    assert io.inputs[0].dim_names() == ("batch", 16, 3, "height", "width")
    assert io.outputs[0].dim_names() == ("batch", 3, 9, "image_height", "image_width")  # 4 × 3 - 3 frames
    assert set(shapes.dim_ranges(io)) == {"batch", "height", "width", "image_height", "image_width"}


def test_a_vae_spec_spanning_frame_counts_is_refused(wan22):
    """expand splits a frame range per count; a hand-made spec that spans several gets a clear refusal."""
    config = load_model_config(wan22, "wan", "vae_decoder")
    (group,) = group_specs([_spec("vae_decoder", Bucket(Size(32, 32, 5), Size(32, 32, 5), Size(32, 32, 13)))])
    with pytest.raises(ExportError, match=r"spans 5\.\.13 frames.*one bucket per frame count \(5, 9, 13\)"):
        export_shapes(group, get_component("wan", "vae_decoder"), config)


def test_profiles_are_five_dimensional(wan22):
    bucket = Bucket(Size(32, 32, 5), Size(48, 32, 9), Size(48, 48, 17))
    transformer = get_component("wan", "transformer").profile(
        _spec("transformer", bucket, batch=2), load_model_config(wan22, "wan", "transformer"))
    assert transformer["hidden_states"] == ((2, 16, 2, 4, 4), (2, 16, 3, 4, 6), (2, 16, 5, 6, 6))
    assert transformer["encoder_hidden_states"] == ((2, WAN_TEXT_LENGTH, 32),) * 3
    vae = get_component("wan", "vae_decoder").profile(_spec("vae_decoder", _static("48x32x9")),
                                                      load_model_config(wan22, "wan", "vae_decoder"))
    assert vae == {"latent": ((1, 16, 3, 4, 6),) * 3}


@pytest.fixture(scope="module")
def wan_export(wan22, tmp_path_factory, write_engines_yaml):
    config = write_engines_yaml(tmp_path_factory.mktemp("wan-export"), wan22, "wan", buckets=["32x32x5"],
                                precision={"text_encoder": "fp32", "transformer": "fp32", "vae_decoder": "fp32"})
    return api.export(config)


@pytest.mark.slow  # four dynamo exports of the tiny Wan 2.2 (about 60 s on 2 shared cores)
def test_every_wan_component_exports_and_matches_pytorch(wan_export):
    results = {r.group.name: r for r in wan_export.results}
    assert list(results) == ["wan-tiny.text_encoder.fp32", "wan-tiny.transformer.fp32",
                             "wan-tiny.transformer_2.fp32", "wan-tiny.vae_decoder.5frames.fp32"]
    for result in results.values():
        assert result.parity and all(c["passed"] for c in result.parity), result.parity
        assert len({c["geometry"] for c in result.parity}) >= 2
    assert _io_dims(results["wan-tiny.text_encoder.fp32"].onnx_path) == {
        "input_ids": ["batch", WAN_TEXT_LENGTH], "attention_mask": ["batch", WAN_TEXT_LENGTH],
        "hidden_states": ["batch", WAN_TEXT_LENGTH, 32]}
    for expert in ("transformer", "transformer_2"):
        result = results[f"wan-tiny.{expert}.fp32"]
        dims = _io_dims(result.onnx_path)
        assert dims["hidden_states"] == dims["noise_pred"] == ["batch", 16, "latent_frames", "height", "width"]
        assert result.dynamic_ranges["latent_frames"] == [2, 3]
        assert {c["geometry"] for c in result.parity} >= {"batch 2, 32x32x5", "batch 3, 48x48x9"}
    vae = results["wan-tiny.vae_decoder.5frames.fp32"]
    assert _io_dims(vae.onnx_path) == {"latent": ["batch", 16, 2, "height", "width"],
                                       "video": ["batch", 3, 5, "image_height", "image_width"]}
    assert all(c["psnr_db"] is None or c["psnr_db"] > 60 for c in vae.parity)


@pytest.mark.slow  # one dynamo export of the tiny VAE over two frame counts (about 40 s)
def test_a_frames_axis_the_exporter_freezes_is_refused(wan22, tmp_path):
    """docs/video.md: the whole-clip decode exports with a dynamic frames axis, but dynamo freezes it to the example's
    count without an error. Exported so anyway, the read-back of the raw graph's inputs refuses it."""
    from trt_diffusion.export.graph_passes import finalize_graph
    from trt_diffusion.export.torch_export import export_module
    from trt_diffusion.models.loading import load_component

    config = load_model_config(wan22, "wan", "vae_decoder")
    definition = get_component("wan", "vae_decoder")
    (group,) = group_specs([_spec("vae_decoder", _static("32x32x9"))])
    fixed = export_shapes(group, definition, config)
    dynamic = dataclasses.replace(fixed, fixed={}, ranges={**fixed.ranges, "frames": (2, 3)})
    io = definition.io(config, {})
    module = load_component(wan22, "vae_decoder")
    wrapper = definition.wrapper(module, config, {})
    raw = tmp_path / "raw" / "model.onnx"
    raw.parent.mkdir()
    export_module(wrapper, definition.dummy_inputs(config, {}, dynamic.example), io, dynamic, 20, raw, "vae")
    names = {name for name, _ in module.named_parameters()}
    with pytest.raises(ExportError, match=r"froze dims declared dynamic.*'latent' dim 2 \(latent_frames\) is fixed at 3"):
        finalize_graph(raw, tmp_path / "model.onnx", io, names, "model.", "vae")


def test_a_transformer_too_large_to_check_at_its_bucket_is_checked_smaller():
    """The 1.3B Wan transformer at 832x480x17 (config only, no weights): one attention score tensor at the widened
    corner would be 8.7 GiB, so the same dynamic graph is traced and checked at smaller shapes whose scores fit the
    budget; its dims still span the bucket."""
    from trt_diffusion.components.model_config import ModelConfig
    from trt_diffusion.export.shapes import CHECK_SCORE_BYTES
    from trt_diffusion.models.tiny_video import WAN_1_3B_TRANSFORMER

    config = ModelConfig(dict(WAN_1_3B_TRANSFORMER), vae_scale_factor=8, latent_channels=16, sequence_length=512)
    definition = get_component("wan", "transformer")
    (group,) = group_specs([_spec("transformer", _static("832x480x17"))])
    shapes = export_shapes(group, definition, config)
    assert [g.label() for g in shapes.parity] == ["batch 1, 208x112x5", "batch 2, 224x128x9"]
    assert shapes.example == shapes.parity[1]
    assert all(definition.attention_score_bytes(config, g) <= CHECK_SCORE_BYTES for g in shapes.parity)
    assert shapes.ranges["frames"] == (2, 6) and shapes.ranges["height"] == (14, 62)  # the bucket and the checks
    assert "at batch 2, 848x496x21 one attention score tensor is 8.7 GiB" in shapes.to_json()["smaller_check"]


def test_the_tiny_transformer_is_checked_at_its_bucket(wan22):
    config = load_model_config(wan22, "wan", "transformer")
    (group,) = group_specs([_spec("transformer", _static("32x32x5"), batch=2)])
    shapes = export_shapes(group, get_component("wan", "transformer"), config)
    assert shapes.smaller_check is None and "smaller_check" not in shapes.to_json()
