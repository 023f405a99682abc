"""The Makefile: a target for every README command, recipes that run the right command, and a no-op
`make build-engines` that does not start the micro-model command once the model exists.

Dry runs only (`make -n`), with the venv marked as up to date (`-o`): nothing is installed or built.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TD = ".venv/bin/trt-diffusion"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def dry_run(*args: str) -> list[str]:
    # Under CI's `make test` the environment carries MAKELEVEL/MAKEFLAGS, and a nested make prints
    # "Entering directory" lines: run it as a top-level make.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    done = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


@pytest.fixture
def micro_present(tmp_path) -> str:
    folder = tmp_path / "micro-sd15"
    folder.mkdir()
    (folder / "trt_diffusion_tiny.json").write_text("{}")
    return f"MICRO={folder}"


def test_noop_build_engines_skips_the_micro_model_command(micro_present):
    assert dry_run("build-engines", micro_present) == [f"{TD} plan engines.yaml", f"{TD} build engines.yaml"]


def test_a_missing_micro_model_is_written(tmp_path):
    lines = dry_run("build-engines", f"MICRO={tmp_path / 'absent'}")
    assert lines[0] == f"{TD} models micro --family sd15 --out {tmp_path / 'absent'} --if-missing"


def test_package_and_serve_do_what_the_readme_says(micro_present):
    assert dry_run("package", micro_present)[-1] == f"{TD} package engines.yaml --out triton_repo"
    lines = dry_run("serve", micro_present)
    assert lines[-2:] == [f"{TD} package engines.yaml --out triton_repo", f"{TD} serve --repo triton_repo --openai-port 8080"]


def test_generate_passes_the_prompt_quoted():
    assert dry_run("generate", "PROMPT=a lighthouse at dusk") == [
        f'{TD} generate --url 127.0.0.1:8000 --prompt "a lighthouse at dusk" -o out.png'
    ]


def test_the_default_prompt_is_in_the_micro_model_vocabulary():
    from trt_diffusion.synthetic_world import parse_caption

    (line,) = dry_run("generate")
    assert parse_caption(line.split('--prompt "')[1].split('"')[0]) is not None


def test_every_readme_command_has_a_make_target(micro_present):
    readme = (ROOT / "README.md").read_text()
    commands = set(re.findall(r"^\| `(\w+)[ `]", readme, flags=re.MULTILINE))  # the commands table
    commands |= set(re.findall(r"^\|[^|]*/ `(\w+) ", readme, flags=re.MULTILINE))  # `serve ...` / `generate ...`
    commands |= set(re.findall(r"^\.venv/bin/trt-diffusion (\w+)", readme, flags=re.MULTILINE))
    commands |= set(re.findall(r"^make ([\w-]+)", readme, flags=re.MULTILINE))
    commands -= {"models"}  # `make models` writes the default; other families are `trt-diffusion models tiny ...`
    assert {"plan", "export", "quantize", "build", "refit", "parity", "package", "serve", "generate"} <= commands
    for command in sorted(commands):
        lines = dry_run(command, micro_present)
        if command in ("build-engines", "test", "test-slow", "test-gpu"):
            continue  # not a trt-diffusion command
        assert any(line.startswith(f"{TD} {command} ") for line in lines), (command, lines)
    assert not any(line.startswith(TD) for line in dry_run("models", micro_present))
