"""`generate --lora` refuses a bad NAME[:SCALE] in one line, before any request (issue 28). Fast: no server."""

from __future__ import annotations

import pytest

from trt_diffusion.cli import main


@pytest.mark.parametrize("value, message", [
    (":0.5", "expected NAME or NAME:SCALE"),
    ("style:abc", "the scale 'abc' is not a number"),
    ("style:nan", "must be a finite number"),
])
def test_a_bad_lora_option_is_one_message(value, message, capsys, tmp_path):
    args = ["generate", "--url", "127.0.0.1:9", "--prompt", "x", "--height", "64", "--width", "64", "--lora", value,
            "-o", str(tmp_path / "x.png")]
    assert main(args) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err


def test_the_same_lora_twice_is_refused(capsys, tmp_path):
    args = ["generate", "--url", "127.0.0.1:9", "--prompt", "x", "--height", "64", "--width", "64", "--lora", "a",
            "--lora", "a:0.5", "-o", str(tmp_path / "x.png")]
    assert main(args) != 0
    assert "LORAS names 'a' twice" in " ".join(capsys.readouterr().err.split())
