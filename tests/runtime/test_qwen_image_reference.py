"""Qwen-Image's loop over the torch-reference runners equals diffusers' QwenImagePipeline of the same tiny folder,
bit for bit (issue #26): square and non-square, true CFG on and off, several images per prompt, prompts near and
past the text limit, a request's max_sequence_length."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners

PROMPT = "a lighthouse on a cliff at dusk"
NEGATIVE = "blurry, low quality"
# the tiny tokenizer is byte-level outside the template's words: one token per character, and the template's
# 5-token tail after the prompt
NEAR_LIMIT = ("fox " * 127)[:507]  # 507 + 5 = 512 text tokens: diffusers' max_sequence_length, the engines' max
PAST_LIMIT = "fox " * 200  # 805 text tokens: diffusers truncates the states to 512, the runtime the ids to 34 + 512


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("qwen_image")


@pytest.fixture(scope="module")
def runners(folder):
    return reference_runners(folder, "qwen_image")


@pytest.fixture(scope="module")
def ours(folder, runners):
    return EnginePipeline(folder, "qwen_image", runners)


@pytest.fixture(scope="module")
def theirs(folder):
    pipe = QwenImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_images(pipe, *, prompt=PROMPT, negative_prompt=None, guidance=4.0, height=64, width=64, steps=3,
                     seed=0, batch=1, **extra):
    images = pipe(prompt, negative_prompt=negative_prompt, true_cfg_scale=guidance, height=height, width=width,
                  num_inference_steps=steps, num_images_per_prompt=batch,
                  generator=torch.Generator().manual_seed(seed), output_type="np", **extra).images
    return (images * 255).round().astype(np.uint8)  # as the FLUX test converts diffusers' floats


def request(*, prompt=PROMPT, negative_prompt=None, guidance=4.0, height=64, width=64, steps=3, seed=0, batch=1,
            **extra) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, negative_prompt=negative_prompt, guidance_scale=guidance, height=height,
                             width=width, steps=steps, seed=seed, batch=batch, **extra)


@pytest.mark.parametrize("case", [
    dict(),  # no negative prompt: true CFG off whatever the scale (diffusers' do_true_cfg)
    dict(negative_prompt=NEGATIVE, guidance=1.0),  # a negative prompt at scale 1: off too
    dict(negative_prompt=NEGATIVE, guidance=4.0, seed=3),  # true CFG: two calls, their own text lengths
    dict(negative_prompt="", guidance=2.5, height=64, width=96, batch=2, seed=11),  # non-square, 2 per prompt
    dict(negative_prompt=NEGATIVE, guidance=5.0, height=96, width=64, steps=4, seed=2),
], ids=["cfg-off", "cfg-off-scale-1", "cfg-on", "nonsquare-wide-2-images", "nonsquare-tall"])
def test_equals_diffusers(ours, theirs, case):
    generation = ours.generate(request(**case))
    assert generation.cfg_mode == ("split" if case.get("negative_prompt") is not None
                                   and case.get("guidance", 4.0) > 1 else "none")
    expected = diffusers_images(theirs, **case)
    assert generation.images.shape == expected.shape
    np.testing.assert_array_equal(generation.images, expected)


@pytest.mark.parametrize("prompt", [NEAR_LIMIT, PAST_LIMIT], ids=["near-limit", "past-limit"])
def test_long_prompts_equal_diffusers(ours, theirs, prompt):
    """512 text tokens (the limit, fed whole) and 805 (diffusers encodes them all and keeps 512 states; the runtime
    encodes the first 34 + 512 ids only, which the causal encoder gives the same states for)."""
    case = dict(prompt=prompt, negative_prompt=NEGATIVE, guidance=4.0, seed=4)
    np.testing.assert_array_equal(ours.generate(request(**case)).images, diffusers_images(theirs, **case))


def test_max_sequence_length_equals_diffusers(ours, theirs):
    case = dict(prompt=NEAR_LIMIT, negative_prompt=NEGATIVE, guidance=3.0, seed=9)
    np.testing.assert_array_equal(ours.generate(request(**case, max_sequence_length=40)).images,
                                  diffusers_images(theirs, **case, max_sequence_length=40))


def test_engines_with_a_shorter_text_range_truncate_there(folder, runners, theirs):
    """engines.yaml's text_length max 256: a request's default keeps 256 tokens (diffusers' 512 cannot be served),
    the same image as diffusers' max_sequence_length=256."""
    short = EnginePipeline(folder, "qwen_image", runners, text_lengths=(2, 64, 256))
    case = dict(prompt=PAST_LIMIT, negative_prompt=NEGATIVE, guidance=4.0, seed=6)
    np.testing.assert_array_equal(short.generate(request(**case)).images,
                                  diffusers_images(theirs, **case, max_sequence_length=256))
    with pytest.raises(RuntimeInputError, match="MAX_SEQUENCE_LENGTH must be between 2 and 256, got 512 .*max is 256"):
        short.generate(request(max_sequence_length=512))


@pytest.mark.parametrize("value,fragment", [
    (513, "between 2 and 512, got 513 \\(the engines' text_length max is 512"),
    (1, "between 2 and 512, got 1"),
    (12.5, "must be a whole number"),
])
def test_bad_max_sequence_length_is_a_clear_error(ours, value, fragment):
    with pytest.raises(RuntimeInputError, match=fragment):
        ours.validate(request(max_sequence_length=value))


def test_without_a_vae_encoder_only_txt2img_is_served_and_requests_run_alone(ours):
    assert ours.workflows == (ours.workflows[0],) and ours.workflows[0].value == "txt2img"
    _, batches = ours.plan_batches([request(seed=1), request(seed=2)])
    assert batches == [[0], [1]]  # each request's rows and text length are its own transformer calls


def test_the_encoder_sees_diffusers_ids_cut_to_the_engines_longest(folder, runners, ours):
    """What the long-prompt tests rest on: the near-limit prompt is fed whole (34 + 512 ids, as diffusers feeds it),
    the past-limit one (34 + 805 ids in diffusers) cut to 34 + 512; the negative prompt has its own length."""
    from trt_diffusion.runtime.engines import RunnerTable

    seen = []
    encoder = runners.find("text_encoder", size=None, batch=1)

    class Recording:
        inputs, name = encoder.inputs, "recording"

        def run(self, feeds):
            seen.append(feeds["input_ids"].shape)
            return encoder.run(feeds)

    table = RunnerTable([e for e in runners.entries if e.component != "text_encoder"])
    table.add("text_encoder", Recording())
    with ours.runners_swapped(table):
        for prompt in (NEAR_LIMIT, PAST_LIMIT):
            ours.encode(request(prompt=prompt, negative_prompt=NEGATIVE))
    tokenizer = ours.tokenizers["tokenizer"]
    negative = 34 + len(tokenizer([NEGATIVE]).input_ids[0]) + 5  # the template's 34 and its 5-token tail
    assert seen == [(1, 546), (1, negative), (1, 546), (1, negative)]
    assert len(tokenizer([PAST_LIMIT]).input_ids[0]) == 800  # so diffusers' sequence is 34 + 805 ids


# --- the built engines (slow) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def built_qwen(built_qwen_image):
    """The session's tiny Qwen-Image engines (tests/conftest.py: onnxruntime and openvino, fp32, cfg split)."""
    return built_qwen_image


@pytest.mark.slow
def test_generate_runs_the_qwen_image_engines_end_to_end(built_qwen, ours, tmp_path):
    """`trt-diffusion generate --config` over the onnxruntime engines with true CFG: the PNG is the EnginePipeline's
    image over the same engines, and within a level of the torch reference's (fp32 ONNX Runtime rounds its own
    way: not bit for bit, by design)."""
    from PIL import Image

    from trt_diffusion.cli import main
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import built_engines, table_from_engines

    out = tmp_path / "qwen.png"
    assert main(["generate", "--config", str(built_qwen), "--prompt", PROMPT, "--negative-prompt", NEGATIVE,
                 "--guidance-scale", "4", "--height", "64", "--width", "64", "--steps", "3", "--seed", "5",
                 "-o", str(out)]) == 0
    config = load_engines_file(built_qwen)
    engines = EnginePipeline(config.models["qwen_image"].source.path, "qwen_image",
                             table_from_engines(built_engines(config, "qwen_image", "onnxruntime")))
    case = request(negative_prompt=NEGATIVE, guidance=4.0, seed=5)
    generation = engines.generate(case)
    assert generation.cfg_mode == "split"
    np.testing.assert_array_equal(np.asarray(Image.open(out)), generation.images[0])
    difference = np.abs(generation.images.astype(int) - ours.generate(case).images)
    assert difference.max() <= 1, difference.max()  # seen: 1 level, in 0.008% of the values


@pytest.mark.slow
def test_parity_passes_on_both_cpu_targets(built_qwen, tmp_path):
    """`trt-diffusion parity`: every image of the onnxruntime and openvino engines against the torch reference, true
    CFG on (parity gives Qwen-Image an empty negative prompt), for each workflow the model declares: txt2img, and
    img2img and inpaint over the same engines with the VAE encoder (the build is a no-op: the fixture built it)."""
    import yaml

    from trt_diffusion import api

    document = yaml.safe_load(built_qwen.read_text())
    document["models"]["qwen_image"]["workflows"] = ["txt2img", "img2img", "inpaint"]
    config = built_qwen.parent / "engines-workflows.yaml"
    config.write_text(yaml.safe_dump(document))
    run = api.parity(config, out_dir=tmp_path / "parity", targets=["onnxruntime", "openvino"])
    assert {(v.target, v.workflow) for v in run.report.variants} == {
        (target, workflow) for target in ("onnxruntime", "openvino") for workflow in ("txt2img", "img2img", "inpaint")}
    assert run.report.passed, [(v.target, v.workflow, v.failure_reasons) for v in run.report.variants]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_transformer_passes_its_gate_and_parity(built_qwen, tmp_path, precision):
    """Acceptance 2 of #26: the MMDiT quantized through ModelOpt (the legacy trace with the real rotation, the packed
    tokens fed as their patch grid), gated on QwenImagePipeline's own generations with true CFG, built beside the
    fp32 engines (encoder and VAE reused) and judged by parity on the precision's bar."""
    import yaml

    from trt_diffusion import api
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.quantize.stage import quantize_component

    document = yaml.safe_load(built_qwen.read_text())
    model = document["models"]["qwen_image"]
    model["precision"]["transformer"] = precision
    model["quantization"] = {"calibration": {"samples": 2, "steps": 2, "seed": 0}}
    quantized = built_qwen.parent / f"engines-{precision}.yaml"
    quantized.write_text(yaml.safe_dump(document))
    report = api.build(quantized, target="onnxruntime")
    assert not report.failed, [o.error for o in report.failed]
    config = load_engines_file(quantized, check_sources=True)
    artifact = quantize_component(config.models["qwen_image"], "transformer", precision, None, config.workspace,
                                  opset=config.build.opset, config_root=config.root)
    assert artifact.cached and artifact.gate["passed"], artifact.gate
    assert artifact.gate["calls"] == 2 * 2 * 2  # true CFG: two calls a step
    assert artifact.manifest["quantized_layers"] and not artifact.manifest["static_shapes"]
    # the Q/DQ graph takes any text length (a legacy trace once baked the calibration prompt's): 20 and 300 tokens
    import onnxruntime as ort

    from trt_diffusion.components import Geometry
    from trt_diffusion.engines_file import Size
    from trt_diffusion.quantize.feeds import denoiser_interface

    interface = denoiser_interface(config.models["qwen_image"], "transformer")
    session = ort.InferenceSession(str(artifact.onnx_path), providers=["CPUExecutionProvider"])
    for text in (20, 300):
        feeds = interface.definition.dummy_inputs(interface.config, {}, Geometry(1, Size(64, 64), text=text))
        assert session.run(None, feeds)[0].shape == (1, 4, 4, 64)
    run = api.parity(quantized, out_dir=tmp_path / "parity", targets=["onnxruntime"])
    (variant,) = run.report.variants
    assert variant.precision == precision and variant.passed, variant.failure_reasons


@pytest.mark.slow
def test_quantized_text_encoder_passes_its_gate_and_parity(built_qwen, tmp_path):
    """#26's language-model encoder engine in int8 (quantize/encoder.py): calibrated on the runtime's own tokens
    (the template, the empty negative prompt), the vision tower and LM head left out, gated on the hidden states,
    dynamic in batch and text length, built beside the fp32 transformer and judged by parity on the int8 bar."""
    import onnxruntime as ort
    import yaml

    from trt_diffusion import api
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.quantize.stage import quantize_component

    document = yaml.safe_load(built_qwen.read_text())
    model = document["models"]["qwen_image"]
    model["precision"]["text_encoder"] = "int8"
    model["targets"] = ["onnxruntime"]
    model["quantization"] = {"calibration": {"samples": 2, "steps": 2, "seed": 0}}
    quantized = built_qwen.parent / "engines-int8-encoder.yaml"
    quantized.write_text(yaml.safe_dump(document))
    report = api.build(quantized)
    assert not report.failed, [o.error for o in report.failed]
    config = load_engines_file(quantized, check_sources=True)
    artifact = quantize_component(config.models["qwen_image"], "text_encoder", "int8", None, config.workspace,
                                  opset=config.build.opset, config_root=config.root)
    assert artifact.cached and artifact.gate["passed"] and artifact.gate["calls"] == 3, artifact.gate
    assert artifact.manifest["excluded_layers"] == {"model.visual": "not run by the engine",
                                                    "lm_head": "not run by the engine"}
    session = ort.InferenceSession(str(artifact.onnx_path), providers=["CPUExecutionProvider"])
    for batch, length in ((1, 36), (2, 300)):  # traced at the first calibration prompt's length, batch 2
        ids = np.ones((batch, length), np.int64)
        assert session.run(None, {"input_ids": ids, "attention_mask": ids})[0].shape == (batch, length, 32)
    run = api.parity(quantized, out_dir=tmp_path / "parity", targets=["onnxruntime"])
    (variant,) = run.report.variants
    assert variant.precision == "int8" and variant.passed, variant.failure_reasons

