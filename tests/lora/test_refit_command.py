"""The `refit` command on the onnxruntime target, over the shared build (its UNet is refittable: a `mode: refit`
LoRA). ONNX Runtime refits when a session is created: the command checks each LoRA fits every refittable
engine by creating that session, and writes nothing."""

from __future__ import annotations

import pytest

from trt_diffusion.cli import main
from trt_diffusion.engines_file import load_engines_file

UNET = "sd15-tiny.unet.64x64.b2.fp32"
TEXT_ENCODER = "sd15-tiny.text_encoder.b1.fp32"  # refittable too: LoRAs may carry a text-encoder part


def _rows(out: str) -> dict[str, int]:
    """engine -> weights replaced, from the command's table."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.replace("│", "|").split("|") if c.strip()]
        if len(cells) == 3 and cells[0].startswith("sd15-tiny."):
            rows[cells[0]] = int(cells[1])
    return rows


def _files(workspace):
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in workspace.rglob("*") if p.is_file()}


@pytest.fixture
def wide_console(monkeypatch):
    from trt_diffusion import cli

    monkeypatch.setattr(cli.console, "width", 200)


def test_refit_applies_the_lora_to_the_refittable_unet_and_writes_nothing(built_sd15, lora_a, lora_b, capsys,
                                                                          wide_console):
    workspace = load_engines_file(built_sd15).workspace
    before = _files(workspace)
    assert main(["refit", str(built_sd15), "--model", "sd15-tiny", "--lora", f"{lora_a}:0.8",
                 "--lora", str(lora_b)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {UNET, TEXT_ENCODER}  # the refittable engines; the VAE and ControlNet are not
    assert rows[UNET] > 0  # A's attention projections and B's convolutions and feed-forwards
    assert rows[TEXT_ENCODER] == 0  # neither LoRA has a text-encoder part: it is refitted back to its base
    assert _files(workspace) == before


def test_refit_base_restores_without_weights(built_sd15, capsys, wide_console):
    assert main(["refit", str(built_sd15), "--model", "sd15-tiny", "--base"]) == 0
    assert _rows(capsys.readouterr().out) == {UNET: 0, TEXT_ENCODER: 0}


def test_a_lora_that_fits_no_weight_is_refused(built_sd15, lora_a, rewrite_lora, capsys):
    broken = rewrite_lora(lora_a, lambda s: {k.replace("to_k", "to_kk"): v for k, v in s.items()}, "refit-cli-broken")
    assert main(["refit", str(built_sd15), "--model", "sd15-tiny", "--lora", str(broken)]) == 1
    assert "match no weight" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("args,message", [
    ([], "give --lora FILE[:SCALE] (repeatable) or --base"),
    (["--lora", "missing.safetensors"], "missing.safetensors"),
])
def test_refit_user_errors(built_sd15, capsys, args, message):
    assert main(["refit", str(built_sd15), "--model", "sd15-tiny", *args]) == 1
    assert message in " ".join(capsys.readouterr().err.split())
