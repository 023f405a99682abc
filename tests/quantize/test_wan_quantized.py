"""Quantized Wan transformers (issue #24): int8 and fp8 through the quantize stage's torch route (ModelOpt PTQ
calibrated on WanPipeline's own generations, the legacy exporter with Wan's rotary rewritten out of place so the
Q/DQ graph keeps its dynamic batch/frames/height/width), gated on the pipeline's clips, built for onnxruntime and
openvino, and judged by `parity` against the fp32 torch reference.

Measured on the tiny random-weight Wan 2.1 (32x32x5, 2 calibration samples x 2 steps, an AMX Xeon): gate, worst
held-out transformer call int8 64.0 dB / fp8 52.6 dB, worst clip frame int8 54.0 dB / fp8 42.2 dB (SSIM >= 0.998);
parity at 2 steps, worst frame: int8 onnxruntime 50.8 dB (SSIM 0.9996), openvino 36.5 dB (0.993); fp8
onnxruntime 30.0 dB (0.970), openvino 35.5 dB (0.992). Why the onnxruntime fp8 engine is lower is open
(docs/quantize.md); the verdicts pass regardless and are asserted as measured, not tuned.
"""

from __future__ import annotations

import glob

import onnxruntime as ort
import pytest
import torch
import yaml

from trt_diffusion import api
from trt_diffusion.components import Geometry
from trt_diffusion.engines_file import Size, load_engines_file
from trt_diffusion.metrics import psnr
from trt_diffusion.models.loading import load_component
from trt_diffusion.parity.stage import ParityOptions, run_parity
from trt_diffusion.quantize.calibration import CalibrationRecipe
from trt_diffusion.quantize.defaults import DENOISER_MIN_PSNR_DB
from trt_diffusion.quantize.feeds import denoiser_interface
from trt_diffusion.quantize.gate import GateThresholds
from trt_diffusion.quantize.stage import plan_variant, quantize_component
from trt_diffusion.quantize.trace_patches import functional_rotary
from trt_diffusion.targets import get_target

from .conftest import TINY_CALIBRATION

TARGETS = ("onnxruntime", "openvino")
BUCKET = "32x32x5"
CALLS = TINY_CALIBRATION["samples"] * TINY_CALIBRATION["steps"] * 2  # WanPipeline: CFG as two batch-1 calls
BLOCK_LAYERS = {f"blocks.{b}.{layer}" for b in range(2) for layer in (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
    "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")}


def _wan_model(precision: str, targets=TARGETS, two_expert: bool = False) -> dict:
    experts = ["transformer", "transformer_2"] if two_expert else ["transformer"]
    return {"family": "wan", "buckets": [BUCKET], "batch": [1], "cfg": ["split"], "targets": list(targets),
            "components": ["text_encoder", *experts, "vae_decoder"],
            "precision": {"text_encoder": "fp32", "transformer": precision, "vae_decoder": "fp32"},
            "quantization": {"calibration": dict(TINY_CALIBRATION)}}


@pytest.fixture(scope="module")
def wan_quantized(tiny_model_factory, tmp_path_factory):
    """`wan_quantized(precision) -> (config, build report, parity report)`: one model and workspace, rewritten per
    precision, so the fp32 text encoder and VAE decoder engines of the first build are reused by the second."""
    model_dir = tiny_model_factory("wan")
    root = tmp_path_factory.mktemp("wan-quantized")
    path = root / "engines.yaml"
    done: dict[str, tuple] = {}

    def get(precision: str):
        if precision not in done:
            model = {"source": str(model_dir), **_wan_model(precision)}
            path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build"},
                                            "models": {"wan-tiny": model}}, sort_keys=False))
            report = api.build(path)
            config = load_engines_file(path, check_sources=True)
            run = run_parity(config, root / f"parity-{precision}",
                             ParityOptions(prompts=("a boat drifting on a calm lake",), seeds=(0,), steps=2,
                                           compute_lpips=False))
            done[precision] = (config, report, run.report)
        return done[precision]

    return get


@pytest.mark.slow  # int8 first: exports, calibration, gate, six engines, parity (~100 s); fp8 then reuses the rest
@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_wan_transformer_quantizes_gates_builds_and_passes_parity(wan_quantized, precision):
    config, report, parity = wan_quantized(precision)
    assert not report.failed, [o.error for o in report.failed]
    available = [t for t in TARGETS if get_target(t).unavailable_reason() is None]
    built = {(o.spec.target, o.spec.name) for o in report.outcomes if o.spec.component.value == "transformer"}
    assert built == {(t, f"wan-tiny.transformer.{BUCKET}.b1.{precision}") for t in available}

    # The build quantized through the stage: asking again finds the committed, gated artifact.
    model = config.models["wan-tiny"]
    artifact = quantize_component(model, "transformer", precision, None, config.workspace,
                                  opset=config.build.opset, config_root=config.root)
    assert artifact.cached
    gate = artifact.gate
    assert gate["passed"] and not gate["failures"] and gate["output_nonfinite"] == 0
    assert gate["thresholds"] == GateThresholds.for_precision(precision).to_json()
    assert gate["calls"] == CALLS
    assert gate["output_psnr_db_min"] >= DENOISER_MIN_PSNR_DB[precision]
    # judged on the pipeline's clips: the worst frame against the image bar, and the motion
    assert len(gate["images"]) == 2 and all(image["video"]["frames"] == 5 for image in gate["images"])
    assert all(image["video"]["motion_error"] < 0.5 for image in gate["images"])
    manifest = artifact.manifest
    assert set(manifest["quantized_layers"]) == BLOCK_LAYERS  # the blocks' Linear layers, nothing else
    assert manifest["excluded_layers"]["patch_embedding"] == "patch_embedding"
    assert manifest["excluded_layers"]["condition_embedder.time_proj"] == "condition_embedder"
    assert manifest["excluded_layers"]["proj_out"] == "proj_out"
    assert manifest["calibration"]["frames"] == 5 and manifest["calibration"]["max_sequence_length"] == 512
    assert manifest["static_shapes"] is False

    # The Q/DQ graph is dynamic: another batch, frame count and size than calibration, against fp32 torch.
    interface = denoiser_interface(model, "transformer")
    session = ort.InferenceSession(str(artifact.onnx_path), providers=["CPUExecutionProvider"])
    feeds = interface.definition.dummy_inputs(interface.config, interface.options, Geometry(2, Size(48, 64, 9)),
                                              seed=7)
    assert feeds["hidden_states"].shape == (2, 16, 3, 8, 6)
    with torch.no_grad():
        expected = interface.wrapper(load_component(model.source.path, "transformer"))(
            *[torch.from_numpy(feeds[n]) for n in interface.input_names]).numpy()
    actual = session.run(None, feeds)[0]
    assert psnr(expected, actual, data_range=float(expected.max() - expected.min())) >= \
        DENOISER_MIN_PSNR_DB[precision]

    # parity: every available target's clip against the fp32 reference, on the precision's own bar
    variants = {v.target: v for v in parity.variants}
    assert set(variants) == set(available)
    for target, variant in variants.items():
        assert variant.precision == precision
        assert all(image.video is not None and image.video.frames == 5 for image in variant.images)
        assert variant.passed, (target, variant.failure_reasons)
    assert parity.passed


@pytest.mark.slow  # two experts, each calibrated and gated (~60 s)
@pytest.mark.timeout(600)
def test_the_two_expert_form_quantizes_both_experts(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("wan", variant="two_expert")
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build"}, "models": {
        "wan22": {"source": str(model_dir), **_wan_model("int8", targets=("onnxruntime",), two_expert=True)}}},
        sort_keys=False))
    # transformer_2 has no precision of its own: it follows transformer's (the experts share one architecture)
    report = api.quantize(path)
    assert report.passed and not report.unsupported
    by_component = {a.component: a for a in report.artifacts}
    assert set(by_component) == {"transformer", "transformer_2"}

    model = load_engines_file(path).models["wan22"]
    for component, artifact in by_component.items():
        gate = artifact.gate
        assert gate["passed"] and gate["output_psnr_db_min"] >= DENOISER_MIN_PSNR_DB["int8"]
        # 2 steps at boundary_ratio 0.875: step 1 is the high-noise expert's, step 2 the low-noise one's, so each
        # expert is calibrated and gated on its own half of the calls
        assert gate["calls"] == CALLS // 2
        assert all(image["video"]["frames"] == 5 for image in gate["images"])
        # each artifact holds its own expert's weights: it matches that expert's torch module, not the other's
        interface = denoiser_interface(model, component)
        feeds = interface.definition.dummy_inputs(interface.config, interface.options, Geometry(1, Size(32, 32, 5)),
                                                  seed=3)
        actual = ort.InferenceSession(str(artifact.onnx_path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        measured = {}
        for expert in ("transformer", "transformer_2"):
            with torch.no_grad():
                expected = interface.wrapper(load_component(model_dir, expert))(
                    *[torch.from_numpy(feeds[n]) for n in interface.input_names]).numpy()
            measured[expert] = psnr(expected, actual, data_range=float(expected.max() - expected.min()))
        other = "transformer" if component == "transformer_2" else "transformer_2"
        assert measured[component] >= DENOISER_MIN_PSNR_DB["int8"] > measured[other], measured
    assert len(glob.glob(str(tmp_path / "build" / "calibration" / "wan22.transformer_2.int8.*"))) == 1


# --- fast: no calibration ------------------------------------------------------------------------------------------

def test_the_rotary_rewrite_is_bit_exact_and_restored(tiny_model_factory):
    module = load_component(tiny_model_factory("wan"), "transformer").eval()
    processors = [m.processor for m in module.modules() if hasattr(m, "norm_q")]
    generator = torch.Generator().manual_seed(0)
    for shape in [(1, 16, 2, 4, 4), (2, 16, 3, 6, 8)]:
        inputs = (torch.randn(*shape, generator=generator), torch.rand(shape[0], generator=generator) * 1000,
                  torch.randn(shape[0], 512, 32, generator=generator))
        with torch.no_grad():
            before = module(*inputs, return_dict=False)[0]
            with functional_rotary(module) as rewritten:
                during = module(*inputs, return_dict=False)[0]
            after = module(*inputs, return_dict=False)[0]
        assert rewritten == 4  # self- and cross-attention of both blocks (cross-attention gets no rotary)
        assert torch.equal(before, during) and torch.equal(before, after)
    assert [m.processor for m in module.modules() if hasattr(m, "norm_q")] == processors
    assert not any(m._forward_hooks for m in module.modules())


def test_a_wan_recipe_runs_the_bucket_frames_at_the_engines_text_length(tiny_model_factory, tmp_path):
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": {"m": {
        "source": str(tiny_model_factory("wan", variant="two_expert")), **_wan_model("fp8", two_expert=True)}}}))
    model = load_engines_file(path).models["m"]
    plan = plan_variant(model, "transformer_2", "fp8")
    assert (plan.recipe.width, plan.recipe.height, plan.recipe.frames) == (32, 32, 5)
    assert plan.recipe.max_sequence_length == 512
    assert plan.exclude[-2:] == ("patch_embedding", "condition_embedder")  # Wan's own defaults, after the shared
    assert plan.calibration_hash != plan_variant(model, "transformer", "fp8").calibration_hash
    # an image recipe's JSON, and so its digest and every key made from it, carries no frames field
    image = CalibrationRecipe(prompts=("a",), steps=2, seed=0, algorithm="max", width=64, height=64)
    assert "frames" not in image.to_json()
