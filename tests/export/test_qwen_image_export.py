"""Qwen-Image export: the text length as a profile dimension of the language-model encoder and the transformer
(ranges, parity corners, engine profiles), and (slow) every qwen_image component exported through `api.export` and
verified against PyTorch, built on onnxruntime and openvino, the encoder engines matching PyTorch's hidden states
at the min/opt/max sequence lengths."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from trt_diffusion import api
from trt_diffusion.components import get_component, load_model_config
from trt_diffusion.components.qwen_image import prompt_embeds
from trt_diffusion.engines_file import Bucket, EngineSpec, Size
from trt_diffusion.export import group_specs
from trt_diffusion.export.shapes import export_shapes
from trt_diffusion.families import QWEN_TEMPLATE_TOKENS, QWEN_TEXT_LENGTH

COMPONENTS = ["text_encoder", "transformer", "vae_decoder", "vae_encoder"]
TARGETS = ["onnxruntime", "openvino"]
LENGTHS = (2, 128, QWEN_TEXT_LENGTH)  # prompt tokens: the text axis's min, opt, max (diffusers' max_sequence_length)


@pytest.fixture(scope="module")
def qwen_dir(tiny_model_factory):
    return tiny_model_factory("qwen_image")


def _spec(component: str, bucket: Bucket | None, batch: int = 1) -> EngineSpec:
    return EngineSpec(model="q", family="qwen_image", source="local:x", component=component, target="onnxruntime",
                      precision="fp32", batch=batch, bucket=bucket, build_options=(("opset", 20),))


def _io_dims(onnx_path) -> dict[str, list]:
    model = onnx.load(str(onnx_path), load_external_data=False)
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (*model.graph.input, *model.graph.output)}


def test_the_encoders_text_length_is_dynamic_and_checked_at_min_opt_max(qwen_dir):
    config = load_model_config(qwen_dir, "qwen_image", "text_encoder")
    definition = get_component("qwen_image", "text_encoder")
    (group,) = group_specs([_spec("text_encoder", None)])
    shapes = export_shapes(group, definition, config)
    assert shapes.ranges["text"] == (2, 512) and shapes.example.text == 512
    assert [g.label() for g in shapes.parity] == ["batch 1, 2 text tokens", "batch 2, 128 text tokens",
                                                  "batch 2, 512 text tokens"]
    io = definition.io(config, {})
    assert shapes.dim_ranges(io) == {"batch": (1, 2), "sequence": (36, 546)}  # the template's 34 + the prompt's
    assert definition.profile(_spec("text_encoder", None), config) == {
        "input_ids": ((1, 36), (1, 162), (1, 546)), "attention_mask": ((1, 36), (1, 162), (1, 546))}
    assert shapes.label() == "batch 1-2, text 2-512"


def test_the_transformers_profile_spans_the_bucket_and_the_text_length(qwen_dir):
    config = load_model_config(qwen_dir, "qwen_image", "transformer")
    definition = get_component("qwen_image", "transformer")
    bucket = Bucket(Size(64, 64), Size(96, 64), Size(128, 96))
    profile = definition.profile(_spec("transformer", bucket), config)
    assert profile["hidden_states"] == ((1, 4, 4, 64), (1, 4, 6, 64), (1, 6, 8, 64))  # rows × cols of 2×2 patches
    assert profile["encoder_hidden_states"] == ((1, 2, 32), (1, 128, 32), (1, 512, 32))
    assert profile["encoder_hidden_states_mask"] == ((1, 2), (1, 128), (1, 512))
    (group,) = group_specs([_spec("transformer", Bucket.static(Size(64, 64)))])
    shapes = export_shapes(group, definition, config)
    assert shapes.ranges["text"] == (2, 512) and shapes.ranges["height"] == (8, 10)
    assert set(shapes.dim_ranges(definition.io(config, {}))) == {"batch", "patch_rows", "patch_cols", "text_tokens"}


def test_other_families_have_no_text_axis(tiny_model_factory):
    """The text axis is Qwen-Image's alone: every other export's shapes (and so its artifact hash) are unchanged."""
    folder = tiny_model_factory("flux")
    config = load_model_config(folder, "flux", "transformer")
    (group,) = group_specs([EngineSpec(model="f", family="flux", source="local:x", component="transformer",
                                       target="onnxruntime", precision="fp32", batch=1,
                                       bucket=Bucket.static(Size(64, 64)), build_options=(("opset", 20),))])
    shapes = export_shapes(group, get_component("flux", "transformer"), config)
    assert "text" not in shapes.ranges and all(g.text == 0 for g in shapes.parity)


@pytest.fixture(scope="module")
def qwen_build(built_qwen_image):
    """The session's tiny Qwen-Image build (tests/conftest.py): its export and build reports, read again (cached)."""
    return api.export(built_qwen_image), api.build(built_qwen_image)


@pytest.mark.slow  # the session fixture's four dynamo exports and eight engine builds (about 45 s on 2 cores)
def test_every_qwen_image_component_exports_and_matches_pytorch(qwen_build):
    export, _ = qwen_build
    results = {r.group.name: r for r in export.results}
    assert list(results) == [f"qwen_image.{c}.fp32" for c in COMPONENTS]
    for result in results.values():
        assert result.parity and all(c["passed"] for c in result.parity), result.parity
        assert len({c["geometry"] for c in result.parity}) >= 2
    encoder = results["qwen_image.text_encoder.fp32"]
    assert _io_dims(encoder.onnx_path) == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"],
                                           "hidden_states": ["batch", "sequence", 32]}
    assert encoder.dynamic_ranges["sequence"] == [36, 546]
    assert [c["geometry"] for c in encoder.parity] == [f"batch {b}, {n} text tokens" for b, n in zip((1, 2, 2), LENGTHS)]
    transformer = results["qwen_image.transformer.fp32"]
    dims = _io_dims(transformer.onnx_path)
    assert dims["hidden_states"] == ["batch", "patch_rows", "patch_cols", 64] == dims["noise_pred"]
    assert dims["encoder_hidden_states"] == ["batch", "text_tokens", 32]
    assert transformer.dynamic_ranges["text_tokens"] == [2, 512]
    assert {c["geometry"].split(", ")[-1] for c in transformer.parity} == {f"{n} text tokens" for n in LENGTHS}
    assert _io_dims(results["qwen_image.vae_decoder.fp32"].onnx_path)["images"] == [
        "batch", 3, "image_height", "image_width"]


@pytest.mark.slow  # shares the export above; the builds and the checks add about 10 s
def test_builds_on_onnxruntime_and_openvino(qwen_build):
    _, build = qwen_build
    built = {(o.spec.component.value, o.spec.target) for o in build.outcomes if o.failure is None}
    assert built == {(c, t) for c in COMPONENTS for t in TARGETS}, [o.failure for o in build.outcomes]


def _tokens(pipe, length: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch-1 row of `length` tokens through the pipeline's template (a long prompt cut to the length)."""
    text = pipe.prompt_template_encode.format(" ".join(["a red cat on a green mat"] * 200))
    tokens = pipe.tokenizer([text], max_length=length, truncation=True, padding="max_length", return_tensors="np")
    return tokens["input_ids"].astype(np.int64), tokens["attention_mask"].astype(np.int64)


@pytest.mark.slow  # shares the build above; six engine runs (about 5 s)
@pytest.mark.parametrize("target", TARGETS)
def test_the_encoder_engine_matches_pytorch_hidden_states_at_min_opt_max(qwen_build, qwen_dir, target):
    """Acceptance 3 of #26: the engine against the text encoder as QwenImagePipeline calls it
    (`hidden_states[-1]`), at the profile's 36, 162 and 546 tokens; and the host's drop/split/pad of the engine's
    states against encode_prompt's embeds."""
    from diffusers import QwenImagePipeline

    from trt_diffusion.target_registry import get_target

    _, build = qwen_build
    (outcome,) = [o for o in build.outcomes if o.spec.component == "text_encoder" and o.spec.target == target]
    pipe = QwenImagePipeline.from_pretrained(qwen_dir)
    engine = get_target(target).find(outcome.path.parents[2], outcome.spec)  # <workspace>/engines/<target>/<name>
    assert engine is not None
    runner = get_target(target).runner(engine)
    with runner, torch.no_grad():
        for length in (QWEN_TEMPLATE_TOKENS + n for n in LENGTHS):
            ids, mask = _tokens(pipe, length)
            assert ids.shape == (1, length)
            expected = pipe.text_encoder(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                         output_hidden_states=True).hidden_states[-1].numpy()
            got = runner.run({"input_ids": ids, "attention_mask": mask})["hidden_states"]
            assert got.shape == expected.shape
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())  # seen: 3e-7
        prompts = ["a red cat on a mat", "sky"]
        tokens = pipe.tokenizer([pipe.prompt_template_encode.format(p) for p in prompts], padding=True,
                                max_length=1024 + QWEN_TEMPLATE_TOKENS, truncation=True, return_tensors="np")
        rows = [runner.run({"input_ids": tokens["input_ids"][i:i + 1].astype(np.int64),
                            "attention_mask": tokens["attention_mask"][i:i + 1].astype(np.int64)})["hidden_states"]
                for i in range(2)]  # a batch-1 engine: one call per prompt, as the pipeline's negative prompt
        embeds, mask = prompt_embeds(np.concatenate(rows), tokens["attention_mask"])
        expected, expected_mask = pipe.encode_prompt(prompts, device="cpu")
    np.testing.assert_allclose(embeds, expected.numpy(), rtol=0, atol=1e-5 * np.abs(expected.numpy()).max())
    assert (mask == expected_mask.numpy()).all()


@pytest.mark.slow  # two dynamo exports in fp16 (about 35 s)
def test_the_encoder_and_transformer_export_in_fp16(qwen_dir, tmp_path, write_engines_yaml):
    """fp16 graphs of the language model and the MMDiT (the RoPE rewrite and the dynamic text axis included), checked
    against the fp32 module within the fp16 bar at the three text lengths."""
    config = write_engines_yaml(tmp_path, qwen_dir, "qwen_image", components=["text_encoder", "transformer"],
                                precision={"text_encoder": "fp16", "transformer": "fp16", "vae_decoder": "fp32"})
    results = {r.group.name: r for r in api.export(config, component="text_encoder").results
               + api.export(config, component="transformer").results}
    assert set(results) == {"qwen_image-tiny.text_encoder.fp16", "qwen_image-tiny.transformer.fp16"}
    for result in results.values():
        assert len(result.parity) == 3 and all(c["passed"] for c in result.parity), result.parity
