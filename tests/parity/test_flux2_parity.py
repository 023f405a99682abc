"""FLUX.2 engines beyond the family conformance run (issue #26, acceptance 1 and 3), over its engines: the tiny
FLUX.2 dev and Klein folders' minimal entries (64x64, their defaults: fp32 on onnxruntime and openvino here) over
the session's `family_workspace` (built by the conformance run where it ran first on this worker, else here), the language-model encoder engine equal to the hidden states the pipelines
stack (at the one length they use: every prompt padded to 512), the quantized transformers and encoders through
their gates and parity (built over the same workspace: the fp32 engines they leave alone are reused), and the
checklist in process. Each family's default build, parity per target and served entry (dev: embedded guidance, one
call per step; Klein: true CFG, two batch-1 calls) are tests/families/test_conformance.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.parity.stage import ParityOptions, run_parity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

FAMILIES = ("flux2", "flux2_klein")
TARGETS = ("onnxruntime", "openvino")
CALIBRATION = {"calibration": {"samples": 2, "steps": 2, "seed": 0}}


@pytest.fixture(scope="module")
def built(family_workspace, tmp_path_factory):
    """(engines.yaml, report): both families' minimal entries, built (or found built) in the shared workspace."""
    from family_builds import families_engines_yaml

    path = families_engines_yaml(family_workspace, tmp_path_factory.mktemp("flux2") / "engines.yaml", FAMILIES)
    report = api.build(path)
    assert not report.failed, [o.error for o in report.failed]
    return path, report


@pytest.mark.parametrize("family", FAMILIES)
def test_the_encoder_engine_matches_the_pipelines_stacked_states(built, tiny_model_factory, family):
    """Acceptance 3: the engine against `_get_mistral_3_small_prompt_embeds` / `_get_qwen3_prompt_embeds` on the
    pipeline's own tokens, a short prompt and one cut at the 512 tokens both pipelines pad and truncate to (the only
    sequence length they use: min = opt = max)."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    from trt_diffusion.families import Family
    from trt_diffusion.runtime.flux2_loop import prompt_tokens
    from trt_diffusion.target_registry import get_target

    _, report = built
    pipe = (Flux2Pipeline if family == "flux2" else Flux2KleinPipeline).from_pretrained(tiny_model_factory(family))
    for target in TARGETS:
        (outcome,) = [o for o in report.outcomes if o.spec.component == "text_encoder" and o.spec.target == target
                      and o.spec.model == family]
        engine = get_target(target).find(outcome.path.parents[2], outcome.spec)
        runner = get_target(target).runner(engine)
        with runner, torch.no_grad():
            for prompt in ("a red cat on a mat", "a red cat on a green mat " * 40):
                ids, mask = prompt_tokens(Family(family), pipe.tokenizer, prompt)
                assert ids.shape == (1, 512)
                expected = pipe.encode_prompt(prompt, device="cpu")[0].numpy()
                got = runner.run({"input_ids": ids, "attention_mask": mask})["prompt_embeds"]
                assert got.shape == expected.shape == (1, 512, 48)
                np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_transformers_pass_their_gate_and_parity(family_workspace, built, precision, tmp_path):
    """Acceptance 2: the transformers of both families quantized through ModelOpt (the legacy trace, FLUX.2's
    batched ids taken as the engine's [N, 4]), gated on the pipelines' own generations, built in the same workspace
    (the fp32 encoders and VAEs reused) and judged by parity on the precision's bar."""
    import onnxruntime as ort
    from family_builds import families_engines_yaml

    from trt_diffusion.components import Geometry
    from trt_diffusion.engines_file import Size
    from trt_diffusion.quantize.feeds import denoiser_interface
    from trt_diffusion.quantize.stage import quantize_component

    quantized = families_engines_yaml(family_workspace, tmp_path / "engines.yaml", FAMILIES,
                                      precision={"transformer": precision}, targets=["onnxruntime"],
                                      quantization=CALIBRATION)
    report = api.build(quantized)
    assert not report.failed, [o.error for o in report.failed]
    config = load_engines_file(quantized, check_sources=True)
    for family in FAMILIES:
        artifact = quantize_component(config.models[family], "transformer", precision, None,
                                      config.workspace, opset=config.build.opset, config_root=config.root)
        assert artifact.cached and artifact.gate["passed"], artifact.gate
        assert artifact.gate["calls"] == 2 * 2 * (2 if family == "flux2_klein" else 1)  # Klein: two calls a step
        assert artifact.manifest["quantized_layers"], "nothing was quantized"
        # the Q/DQ graph is dynamic (the trace rotates by strided slices): another batch and size than calibration's
        interface = denoiser_interface(config.models[family], "transformer")
        session = ort.InferenceSession(str(artifact.onnx_path), providers=["CPUExecutionProvider"])
        feeds = interface.definition.dummy_inputs(interface.config, {}, Geometry(2, Size(96, 64)))
        assert session.run(None, feeds)[0].shape == (2, 24, 128)
    run = run_parity(config, tmp_path / "parity",
                     ParityOptions(prompts=("a red fox running through snow",), seeds=(0,), steps=3,
                                   compute_lpips=False))
    variants = {v.model: v for v in run.report.variants}
    assert set(variants) == set(FAMILIES)
    for name, variant in variants.items():
        assert variant.precision == precision and variant.passed, (name, variant.failure_reasons)


def test_quantized_encoders_pass_their_gate_and_parity(family_workspace, built, tmp_path):
    """#26's language-model encoders through ModelOpt (quantize/encoder.py): FLUX.2 dev's Mistral-3 in int8, Klein's
    Qwen3 in fp8, calibrated on the runtime's own tokens, gated on their stacked states, built beside the fp32
    transformers and judged by parity on the quantized bar."""
    import onnxruntime as ort
    import yaml
    from family_builds import families_engines_yaml

    from trt_diffusion.quantize.stage import quantize_component

    chosen = {"flux2": "int8", "flux2_klein": "fp8"}
    quantized = families_engines_yaml(family_workspace, tmp_path / "engines.yaml", FAMILIES, targets=["onnxruntime"],
                                      quantization=CALIBRATION)
    document = yaml.safe_load(quantized.read_text())
    for name, model in document["models"].items():
        model["precision"] = {"text_encoder": chosen[name]}
    quantized.write_text(yaml.safe_dump(document, sort_keys=False))
    report = api.build(quantized)
    assert not report.failed, [o.error for o in report.failed]
    config = load_engines_file(quantized, check_sources=True)
    for name, precision in chosen.items():
        artifact = quantize_component(config.models[name], "text_encoder", precision, None, config.workspace,
                                      opset=config.build.opset, config_root=config.root)
        assert artifact.cached and artifact.gate["passed"], artifact.gate
        assert artifact.gate["calls"] == 2 + (name == "flux2_klein")  # held-out prompts (+ Klein's negative)
        excluded = artifact.manifest["excluded_layers"]
        assert excluded["lm_head"] == "not run by the engine" and artifact.manifest["quantized_layers"]
        if name == "flux2":  # Mistral-3's Pixtral tower and projector are not in the engine
            assert excluded["model.vision_tower"] == excluded["model.multi_modal_projector"] == "not run by the engine"
        session = ort.InferenceSession(str(artifact.onnx_path), providers=["CPUExecutionProvider"])
        ids = np.ones((2, 512), np.int64)  # traced at batch 2: the batch axis stays dynamic
        assert session.run(None, {"input_ids": ids, "attention_mask": ids})[0].shape == (2, 512, 48)
    run = run_parity(config, tmp_path / "parity",
                     ParityOptions(prompts=("a red fox running through snow",), seeds=(0,), steps=3,
                                   compute_lpips=False))
    variants = {v.model: v for v in run.report.variants}
    for name, variant in variants.items():
        assert variant.precision == chosen[name] and variant.passed, (name, variant.failure_reasons)
        assert any(c.component.startswith(f"{name}.text_encoder.b1.{chosen[name]}") for c in variant.components)


@pytest.mark.parametrize("family", FAMILIES)
def test_preflight_passes_in_process(family_workspace, built, family, tmp_path):
    """The pre-launch checklist on each FLUX.2 family in process (dev: one call per step; Klein: true CFG): every
    check that applies passes and the quality baseline is saved. Each family's served entry equal to the in-process
    image is the family conformance run's (tests/families/test_conformance.py); the checklist over a served entry is
    the same code for every family (tests/preflight/test_served.py drives it on sd15)."""
    from family_builds import families_engines_yaml
    from preflight_settings import with_fast_preflight

    from trt_diffusion.preflight.run import run_preflight

    path = families_engines_yaml(family_workspace, tmp_path / "engines.yaml", (family,))
    config = load_engines_file(with_fast_preflight(path, tmp_path / "settings"))
    saved = run_preflight(config, model=family, save_baseline=True, in_process=True, target="onnxruntime",
                          out_dir=tmp_path / "in-process")
    assert saved.baseline is not None
    status = {check.name: check.status for check in saved.report.checks}
    assert all(s in ("pass", "n/a") for s in status.values()), {c.name: c.failures for c in saved.report.checks}
    assert status["reproducibility"] == status["isolation"] == status["cancellation"] == "pass", status
