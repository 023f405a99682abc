"""Every `trt-diffusion` command the README shows in a fenced block parses against the real typer app as written:
the command exists, every option exists, every value has the right type. Parsed in process, never run; the
README's two commands run for real in the slow suite."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import typer

from trt_diffusion.cli import app

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def readme_commands(text: str) -> list[str]:
    """The `trt-diffusion …` lines of the fenced blocks (heredoc bodies left out, comments cut)."""
    commands, heredoc_end = [], None
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.DOTALL):
        for line in block.splitlines():
            if heredoc_end is not None:
                heredoc_end = None if line.strip() == heredoc_end else heredoc_end
                continue
            if "<<" in line:
                heredoc_end = line.split("<<", 1)[1].strip().strip("'\"")
                continue
            words = shlex.split(line, comments=True)
            if words and words[0] == "trt-diffusion":
                commands.append(shlex.join(words))
    return commands


def parse(argv: list[str]):
    """The command that argv selects, parsed (types, required options, choices) but not invoked."""
    group = typer.main.get_command(app)
    ctx = group.make_context("trt-diffusion", list(argv))
    command = group
    while hasattr(command, "resolve_command"):  # a group: its subcommand's name leads the rest
        rest = ctx._protected_args + ctx.args  # typer's bundled click keeps the subcommand's words here
        if not rest:
            break
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)
    return command


COMMANDS = readme_commands(README.read_text())


def test_the_readme_shows_trt_diffusion_commands():
    assert len(COMMANDS) >= 8, COMMANDS


@pytest.mark.parametrize("line", COMMANDS)
def test_a_readme_command_parses_as_written(line):
    command = parse(shlex.split(line)[1:])
    assert command.name != "trt-diffusion"  # it selected a command, not just the group


def test_a_wrong_option_in_the_readme_would_be_caught():
    with pytest.raises(Exception, match="No such option"):
        parse(["generate", "--prompt", "x", "--colour", "red"])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_the_readme_main_command_runs_on_a_fresh_checkout(tmp_path, capsys):
    """`make build-engines` in a copy of the tracked tree, with this venv (installing is CI's own first step): every
    engine of the repository's engines.yaml this machine can build is built, the others' targets are named as
    skipped, and a second build has nothing to do (tests/project/test_repository_engines_yaml.py checks its plan)."""
    import numpy as np
    from PIL import Image

    from trt_diffusion.cli import main
    from trt_diffusion.engines_file import expand, load_engines_file
    from trt_diffusion.prompt_following import follows
    from trt_diffusion.runtime.loader import built_engines
    from trt_diffusion.targets import get_target

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    done = subprocess.run(["make", "--no-print-directory", "build-engines", f"VENV={ROOT / '.venv'}",
                           "-o", f"{ROOT / '.venv'}/.installed"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=1500, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "0 failed" in done.stdout and (tmp_path / "build").is_dir()
    out = " ".join(done.stdout.split())
    config = load_engines_file(tmp_path / "engines.yaml")
    (model,) = config.models
    for target in dict.fromkeys(s.target for s in expand(config)):
        reason = get_target(target).unavailable_reason()
        if reason is None:
            wanted = [s for s in expand(config) if s.target == target and s.lora_variant is None]
            assert len(built_engines(config, model, target)) == len(wanted), target
        else:
            assert f"skipped target {target}" in out
    capsys.readouterr()
    assert main(["build", str(tmp_path / "engines.yaml")]) == 0
    assert " 0 built," in " ".join(capsys.readouterr().out.split())  # the second build has nothing to do

    # the README's first image: the default model draws the Makefile's default prompt (read back by the measure)
    prompt = "a red circle on a blue background"
    assert main(["generate", "--config", str(tmp_path / "engines.yaml"), "--prompt", prompt,
                 "-o", str(tmp_path / "out.png")]) == 0
    drawn = follows(np.asarray(Image.open(tmp_path / "out.png").convert("RGB")), prompt)
    assert drawn == {"background": True, "colour": True, "shape": True, "style": True}, drawn
