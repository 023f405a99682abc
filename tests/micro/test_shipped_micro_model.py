"""The shipped SD1.5 micro-model (issue 43): `models micro` writes it as a diffusers folder the project's own
loading code reads, upcast to fp32; the committed fp16 weights are the trained ones (their sha256), and they still
draw the grid's prompts (slow: the grid's shape figure within 3 points of the recorded one)."""

from __future__ import annotations

import hashlib
import json

import pytest

from trt_diffusion.cli import main
from trt_diffusion.models.micro import DATA, TRAINING_RECORD

SHIPPED = DATA / "sd15"


@pytest.fixture(scope="module")
def micro_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro") / "micro-sd15"
    assert main(["models", "micro", "--family", "sd15", "--out", str(out)]) == 0
    return out


def test_the_shipped_weights_are_small_fp16_and_recorded():
    record = json.loads((SHIPPED / TRAINING_RECORD).read_text())
    weights = sorted(SHIPPED.rglob("*.safetensors"))
    assert weights and sum(p.stat().st_size for p in weights) <= 30 << 20
    assert record["seed"] == 0 and record["script_version"] >= 2
    from safetensors import safe_open

    for path in weights:
        with safe_open(str(path), "pt") as handle:
            assert {str(handle.get_tensor(k).dtype) for k in handle.keys()} == {"torch.float16"}, path
    figures = record["grid"]["figures"]  # the bar the shipped model was trained to (docs/micro-models.md)
    assert figures["shape"] >= 90 and figures["background"] >= 90 and figures["colour"] >= 80, figures
    assert record["weights_sha256"] == {p.relative_to(SHIPPED).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                                        for p in weights}


@pytest.mark.slow
def test_the_micro_model_still_draws_the_grid(micro_folder):
    """The shipped weights, upcast by `models micro`, draw the grid as recorded (fp32 on this CPU: sums may differ
    in the last bits from the training machine's, hence a margin of 3 points rather than equality)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from train_micro import evaluate

    recorded = json.loads((SHIPPED / TRAINING_RECORD).read_text())["grid"]["figures"]
    figures = evaluate(micro_folder)
    assert abs(figures["shape"] - recorded["shape"]) <= 3, (figures, recorded)
