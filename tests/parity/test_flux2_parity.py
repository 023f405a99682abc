"""FLUX.2 engines end to end (issue #26, acceptance 1 and 3): the tiny FLUX.2 dev and Klein folders exported,
built on onnxruntime and openvino, passing the fp32 parity gate against the torch reference (dev: embedded guidance,
one call per step; Klein: true CFG, two batch-1 calls), and the language-model encoder engine equal to the hidden
states the pipelines stack (at the one length they use: every prompt padded to 512). Slow: one shared build of both
families (about two minutes on 2 cores)."""

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
FP32 = {"text_encoder": "fp32", "transformer": "fp32", "vae_decoder": "fp32"}


@pytest.fixture(scope="module")
def built(tiny_model_factory, tmp_path_factory):
    import yaml

    root = tmp_path_factory.mktemp("flux2-engines")
    models = {f"{family}-tiny": {"source": str(tiny_model_factory(family)), "family": family, "buckets": ["64x48"],
                                 "batch": [1], "targets": list(TARGETS), "precision": dict(FP32)} for family in FAMILIES}
    path = root / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build"}, "models": models}))
    report = api.build(path)
    assert not report.failed, [o.error for o in report.failed]
    return path, report


def test_both_families_build_on_both_cpu_targets(built):
    _, report = built
    done = {(o.spec.model, o.spec.component.value, o.spec.target) for o in report.outcomes if o.failure is None}
    assert done == {(f"{f}-tiny", c, t) for f in FAMILIES for c in FP32 for t in TARGETS}
    transformers = {o.spec.model: o.spec.batch for o in report.outcomes if o.spec.component == "transformer"}
    assert transformers == {"flux2-tiny": 1, "flux2_klein-tiny": 1}  # cfg none / split: no batch-2 engine


def test_engines_pass_parity(built, tmp_path):
    path, _ = built
    run = run_parity(load_engines_file(path, check_sources=True), tmp_path / "parity",
                     ParityOptions(prompts=("a red fox running through snow",), seeds=(0,), steps=3,
                                   compute_lpips=False))
    variants = {(v.model, v.target): v for v in run.report.variants}
    assert set(variants) == {(f"{f}-tiny", t) for f in FAMILIES for t in TARGETS}
    for key, result in variants.items():
        assert result.passed, (key, result.failure_reasons)


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
                      and o.spec.model == f"{family}-tiny"]
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
def test_quantized_transformers_pass_their_gate_and_parity(built, precision):
    """Acceptance 2: the transformers of both families quantized through ModelOpt (the legacy trace, FLUX.2's
    batched ids taken as the engine's [N, 4]), gated on the pipelines' own generations, built in the same workspace
    (the fp32 encoders and VAEs reused) and judged by parity on the precision's bar."""
    import yaml

    from trt_diffusion.quantize.stage import quantize_component

    path, _ = built
    document = yaml.safe_load(path.read_text())
    for model in document["models"].values():
        model["precision"]["transformer"] = precision
        model["targets"] = ["onnxruntime"]
        model["quantization"] = {"calibration": {"samples": 2, "steps": 2, "seed": 0}}
    quantized = path.parent / f"engines-{precision}.yaml"
    quantized.write_text(yaml.safe_dump(document))
    report = api.build(quantized)
    assert not report.failed, [o.error for o in report.failed]
    config = load_engines_file(quantized, check_sources=True)
    for family in FAMILIES:
        artifact = quantize_component(config.models[f"{family}-tiny"], "transformer", precision, None,
                                      config.workspace, opset=config.build.opset, config_root=config.root)
        assert artifact.cached and artifact.gate["passed"], artifact.gate
        assert artifact.gate["calls"] == 2 * 2 * (2 if family == "flux2_klein" else 1)  # Klein: two calls a step
        assert artifact.manifest["quantized_layers"], "nothing was quantized"
    run = run_parity(config, path.parent / f"parity-{precision}",
                     ParityOptions(prompts=("a red fox running through snow",), seeds=(0,), steps=3,
                                   compute_lpips=False))
    variants = {v.model: v for v in run.report.variants}
    assert set(variants) == {f"{f}-tiny" for f in FAMILIES}
    for name, variant in variants.items():
        assert variant.precision == precision and variant.passed, (name, variant.failure_reasons)
