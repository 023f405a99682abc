"""FLUX.2 in engines.yaml: `plan` on a manifest with FLUX.2 dev, Klein and Qwen-Image lists their engines with counts,
parameters and disk (acceptance 4 of #26); the families' CFG defaults (dev: none, its guidance is embedded, one call
per step; Klein: split, diffusers' two batch-1 calls), so neither builds a batch-2 transformer unasked; the encoder
engine counts the decoder stack only; what the families refuse, at its line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trt_diffusion import api
from trt_diffusion.cli import main

TARGETS = ["onnxruntime", "openvino"]
COMPONENTS = ["text_encoder", "transformer", "vae_decoder"]


@pytest.fixture(scope="module")
def manifest(tiny_model_factory, tmp_path_factory) -> Path:
    def model(family: str, **extra) -> dict:
        return {"source": str(tiny_model_factory(family)), "family": family, "buckets": ["64x64", "128x96"],
                "batch": [1, 2], "targets": list(TARGETS), "precision": {c: "fp32" for c in COMPONENTS}, **extra}

    models = {"dev": model("flux2"), "klein": model("flux2_klein"), "qwen": model("qwen_image", cfg=["split"])}
    path = tmp_path_factory.mktemp("flux2-plan") / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": models}, sort_keys=False))
    return path


def test_plan_lists_both_flux2_families_beside_qwen_image(manifest):
    plan = api.plan(manifest)
    for name in ("dev", "klein", "qwen"):
        for target in TARGETS:
            assert plan.count(name, "text_encoder", target) == 2  # one per batch, no bucket
            assert plan.count(name, "transformer", target) == 4  # 2 buckets x batches 1, 2: no CFG doubling
            assert plan.count(name, "vae_decoder", target) == 4
        rows = [r for r in plan.rows if r.model == name]
        assert len(rows) == 6 and all(r.parameters and r.disk_bytes == r.engines * r.parameters * 4 for r in rows)
    batches = {(s.model, s.batch) for s in plan.specs if s.component == "transformer"}
    assert batches == {(m, b) for m in ("dev", "klein", "qwen") for b in (1, 2)}
    names = {s.name for s in plan.specs if s.target == "onnxruntime"}
    assert {"dev.transformer.128x96.b2.fp32", "klein.text_encoder.b1.fp32", "dev.vae_decoder.64x64.b1.fp32"} <= names


def test_the_plan_command_lists_them(manifest, capsys):
    assert main(["plan", str(manifest)]) == 0
    out = capsys.readouterr().out
    assert out.count("dev ") >= 6 and out.count("klein ") >= 6


def test_the_cfg_defaults_follow_each_pipeline(manifest):
    from trt_diffusion.engines_file import load_engines_file

    config = load_engines_file(manifest)
    assert [m.value for m in config.models["dev"].cfg] == ["none"]
    assert [m.value for m in config.models["klein"].cfg] == ["split"]
    assert [m.value for m in config.models["qwen"].cfg] == ["split"]


def test_the_encoders_count_their_decoder_stack_only(manifest, tiny_model_factory):
    """FLUX.2's text_encoder folder is the whole Mistral-3 (Pixtral tower, projector, LM head), Klein's a Qwen3 with
    its LM head; the engines are the decoder stacks, and plan counts those."""
    from trt_diffusion.families import Component
    from trt_diffusion.models.loading import load_component

    plan = api.plan(manifest)
    for name, family in (("dev", "flux2"), ("klein", "flux2_klein")):
        module = load_component(tiny_model_factory(family), Component.text_encoder)
        decoder = getattr(module.model, "language_model", module.model)
        row = next(r for r in plan.rows if r.model == name and r.component == "text_encoder")
        assert row.parameters == sum(p.numel() for p in decoder.parameters())
        assert row.parameters < sum(p.numel() for p in module.parameters())


def _with(manifest: Path, tmp_path: Path, model: str, **fields) -> Path:
    document = yaml.safe_load(manifest.read_text())
    document["models"][model].update(fields)
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@pytest.mark.parametrize("model,fields,message", [
    ("dev", {"text_length": {"min": 8, "opt": 64, "max": 256}}, "the flux2 family pads every prompt to one length"),
    ("klein", {"workflows": ["img2img"]}, "img2img"),
    ("dev", {"components": ["text_encoder", "transformer", "vae_decoder", "vae_encoder"]}, "vae_encoder"),
])
def test_what_the_families_refuse_is_named_at_its_line(manifest, tmp_path, capsys, model, fields, message):
    path = _with(manifest, tmp_path, model, **fields)
    assert main(["plan", str(path)]) == 1
    err = capsys.readouterr().err
    assert message in err and f"{path}:" in err and "Traceback" not in err


def test_their_tensorrt_qdq_engines_build_over_bf16(manifest):
    """The clarification of #26: the new DiT families' fp8/int8 TensorRT engines take bf16 as their Q/DQ base, as
    FLUX.1 and SD3 do (targets/tensorrt/precision.py derives it from families.py)."""
    from dataclasses import replace

    from trt_diffusion.targets.tensorrt.precision import qdq_base_precision

    plan = api.plan(manifest)
    for name in ("dev", "klein", "qwen"):
        spec = next(s for s in plan.specs if s.model == name and s.component == "transformer")
        for precision in ("fp8", "int8"):
            assert qdq_base_precision(replace(spec, precision=precision)) == "bf16"


def test_their_language_model_encoders_take_int8_and_fp8(manifest, tmp_path):
    """#26: the encoder engines of the three families quantize (quantize/encoder.py); plan lists them, and a
    variant beside an fp32 transformer is judged by parity on the quantized bar."""
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.parity.stage import judged_precision

    document = yaml.safe_load(manifest.read_text())
    for name, precision in (("dev", "int8"), ("klein", "fp8"), ("qwen", "int8")):
        document["models"][name]["precision"]["text_encoder"] = precision
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    names = {s.name for s in api.plan(path).specs if s.target == "onnxruntime"}
    assert {"dev.text_encoder.b1.int8", "klein.text_encoder.b2.fp8", "qwen.text_encoder.b1.int8"} <= names
    config = load_engines_file(path)
    assert [judged_precision(config.models[m]).value for m in ("dev", "klein", "qwen")] == ["int8", "fp8", "int8"]


def test_only_the_denoiser_and_the_encoder_quantize(manifest, tmp_path, capsys):
    path = _with(manifest, tmp_path, "dev", precision={"text_encoder": "fp32", "transformer": "fp32",
                                                       "vae_decoder": "int8"})
    assert main(["plan", str(path)]) == 1
    err = capsys.readouterr().err
    assert "int8 is for transformer and text_encoder; the quantize stage does not quantize vae_decoder" in err
    assert f"{path}:" in err and "Traceback" not in err
