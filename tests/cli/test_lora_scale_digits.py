"""`generate --lora NAME:SCALE` reads the scale as the user wrote it (issue 44, finding 8): Python's float() also
takes "1_0" (as 10) and other scripts' digits, so `--lora style:1_0` asked for ten times the LoRA. Fast: no server."""

from __future__ import annotations

import re

import pytest

from trt_diffusion.cli import main
from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.triton.lora_sets import LoraChoice, parse_cli_lora


@pytest.mark.parametrize("scale", ["1_0", "0_5", "١", " 1", "1 ", "0x1", "1e1_0", "+-nan", "--inf", "-+Infinity"])
def test_a_scale_that_is_not_a_plain_decimal_is_refused(scale):
    with pytest.raises(RuntimeInputError, match=re.escape(f"the scale {scale!r} is not a number")):
        parse_cli_lora(f"style:{scale}")


@pytest.mark.parametrize("scale, value", [("10", 10.0), ("0.8", 0.8), (".5", 0.5), ("-2", -2.0), ("1e-1", 0.1),
                                          ("+1.", 1.0)])
def test_plain_decimals_are_read(scale, value):
    assert parse_cli_lora(f"style:{scale}") == LoraChoice("style", value)


def test_the_command_refuses_it_in_one_line(capsys, tmp_path):
    args = ["generate", "--url", "127.0.0.1:9", "--prompt", "x", "--height", "64", "--width", "64", "--lora",
            "style:1_0", "-o", str(tmp_path / "x.png")]
    assert main(args) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "--lora 'style:1_0': the scale '1_0' is not a number" in err and "Traceback" not in err
