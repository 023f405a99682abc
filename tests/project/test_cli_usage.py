"""Command-line mistakes are usage errors: click's usage line with its did-you-mean, exit 2, never a traceback
or the internal-error text — which stays for real bugs (exit 3, with the traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trt_diffusion.cli import EXIT_INTERNAL, EXIT_USAGE, main

ROOT = Path(__file__).resolve().parents[2]

MISTAKES = [
    # (argv, a fragment of the one message)
    (["plna"], "No such command 'plna'. Did you mean 'plan'?"),
    (["plan", "engines.yaml", "--jsn"], "No such option: --jsn"),
    (["generate"], "Missing option '--prompt'"),
    (["generate", "--prompt", "x", "--steps", "abc"], "'--steps'"),
    (["build", "engines.yaml", "--jobs", "0"], "'--jobs'"),
    (["generate", "--prompt", "x", "--protocol", "smtp"], "'--protocol'"),
    (["parity", "engines.yaml", "--seeds", "1", "2"], "unexpected extra argument"),
    (["models", "tiny", "--family", "sd9"], "'--family'"),
]


@pytest.mark.parametrize("argv,fragment", MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_an_argv_mistake_is_one_usage_message(argv, fragment, capsys):
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert fragment in " ".join(text.split()), text
    assert "Traceback" not in text and "internal error" not in text
    assert "Try 'trt-diffusion" in text


def test_protocol_names_are_case_insensitive(capsys):
    # `--protocol gRPC` is what people type; it selects gRPC (the request then fails to connect: exit 1, not 2)
    assert main(["generate", "--prompt", "x", "--protocol", "gRPC", "--url", "127.0.0.1:9", "--timeout", "1",
                 "--height", "64", "--width", "64"]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_debug_is_accepted_after_the_command(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing.yaml"), "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_version_answers_without_loading_torch():
    code = ("import sys\nfrom trt_diffusion.cli import main\nrc = main(['--version'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("trt-diffusion ") and any(line.split()[0] == "onnxruntime" for line in lines[1:])


def test_a_real_bug_still_shows_the_traceback_and_exits_3(monkeypatch, capsys):
    from trt_diffusion import api

    def broken(*args, **kwargs):
        raise ZeroDivisionError("injected bug")

    monkeypatch.setattr(api, "plan", broken)
    assert main(["plan", "engines.yaml"]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: injected bug" in err and "internal error" in err
