"""Live progress lines: stage, step k of n, elapsed; a heartbeat while a step runs long; plain lines from
the console script when its stderr is a file."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import pytest

from trt_diffusion import progress


@pytest.fixture
def lines():
    stream = io.StringIO()
    handler = progress.show_plain_lines(stream)
    yield lambda: stream.getvalue().splitlines()
    progress.hide_plain_lines()
    assert handler not in progress.log.handlers


def test_steps_say_stage_position_subject_and_elapsed(lines):
    with progress.task("export", total=3, position=2, subject="sd15.unet", heartbeat_s=0) as task:
        task.step(detail="torch.onnx.export")
    first, step, done = lines()
    assert first.endswith("] export 2/3 sd15.unet: started")
    assert step.endswith("] export 2/3 sd15.unet: torch.onnx.export")
    assert "export 2/3 sd15.unet: done in " in done
    assert first.startswith("[") and "s]" in first  # elapsed, e.g. "[      0.0s]"


def test_a_quiet_step_gets_still_running_lines(lines):
    with progress.task("build", detail="one engine", heartbeat_s=0.05):
        deadline = time.monotonic() + 10
        while not any("still running" in line for line in lines()) and time.monotonic() < deadline:
            time.sleep(0.02)
    assert any(line.endswith("build: one engine (still running)") for line in lines()), lines()


def test_fast_steps_are_thinned_but_the_last_is_shown(lines):
    with progress.task("calibration", total=100, min_interval_s=3600, heartbeat_s=0) as task:
        for k in range(1, 101):
            task.step(k, "denoiser call")
    texts = [line.split("] ", 1)[1] for line in lines()]
    assert texts[0] == "calibration: started"
    assert texts[1] == "calibration 100/100: denoiser call"
    assert texts[2].startswith("calibration 100/100: done in ") and len(texts) == 3


def test_a_failure_is_reported(lines):
    with pytest.raises(ValueError):
        with progress.task("quantize", position=3, total=4, heartbeat_s=0):
            raise ValueError("boom")
    assert "quantize 3/4: failed after" in lines()[-1] and "(ValueError)" in lines()[-1]


def test_nothing_is_printed_or_started_without_a_listener(monkeypatch):
    progress.hide_plain_lines()
    started = []
    monkeypatch.setattr(progress.threading.Thread, "start", lambda self: started.append(self))
    with progress.task("export", heartbeat_s=0.01) as task:
        task.step(1, "x")
    assert started == []


def test_plain_lines_when_stderr_is_not_a_terminal(monkeypatch):
    monkeypatch.setenv("TRT_DIFFUSION_PROGRESS", "")
    assert progress.plain_lines_wanted(io.StringIO())
    monkeypatch.setenv("TRT_DIFFUSION_PROGRESS", "off")
    assert not progress.plain_lines_wanted(io.StringIO())


@pytest.mark.slow  # a real export in a subprocess (~15 s); the lines themselves are checked above
def test_the_console_script_prints_progress_lines_into_a_log_file(tmp_path, tiny_model_dir, write_engines_yaml):
    config = write_engines_yaml(tmp_path, tiny_model_dir("sd15"), "sd15", components=["vae_decoder"],
                                precision={"vae_decoder": "fp32"})
    log_file = tmp_path / "export.log"
    env = {**os.environ, "TRT_DIFFUSION_PROGRESS": ""}
    with log_file.open("w") as stderr:
        done = subprocess.run([sys.executable, "-m", "trt_diffusion", "export", str(config)], stdout=subprocess.PIPE,
                              stderr=stderr, text=True, env=env, timeout=600)
    text = log_file.read_text()
    assert done.returncode == 0, text
    assert "export 1/1 sd15-tiny.vae_decoder.fp32: torch.onnx.export" in text, text
    assert "export 1/1 sd15-tiny.vae_decoder.fp32: ONNX Runtime vs PyTorch" in text, text


def test_every_line_is_stamped_with_one_clock(lines):
    """Successive tasks do not restart the stamp: the lines read as one timeline (stage time in "done in")."""
    import time

    from trt_diffusion import progress

    with progress.task("export", total=2, heartbeat_s=0) as first:
        first.step(1, "a")
    time.sleep(0.15)
    with progress.task("export", total=2, heartbeat_s=0) as second:
        second.step(2, "b")
    stamps = [float(line[1:line.index("s]")]) for line in lines()]
    assert stamps == sorted(stamps) and stamps[-1] - stamps[0] >= 0.1, stamps
