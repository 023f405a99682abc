"""The ONNX store across runs: unchanged inputs are not re-exported, changed ones are, and an interrupted
export leaves nothing a later run trusts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.errors import ExportError
from trt_diffusion.workspace.store import TEMP_PREFIX


def _snapshot(root: Path) -> dict[Path, tuple[int, int]]:
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _onnx_dir(config: Path) -> Path:
    return load_engines_file(config).workspace / "onnx"


def _perturb(weights: Path, name: str, scale: float = 1.0, shift: float = 0.0) -> None:
    tensors = load_file(weights)
    tensors[name] = tensors[name] * scale + shift
    save_file(tensors, weights, metadata={"format": "pt"})


def test_second_export_is_a_no_op(sd15_export):
    before = _snapshot(_onnx_dir(sd15_export.config))
    report = api.export(sd15_export.config)
    assert [r.cached for r in report.results] == [True] * len(sd15_export.report.results)
    assert [r.onnx_path for r in report.results] == [r.onnx_path for r in sd15_export.report.results]
    assert _snapshot(_onnx_dir(sd15_export.config)) == before  # same inodes, same mtimes: nothing rewritten


@pytest.mark.slow  # a second UNet export (about 25 s)
def test_changed_unet_weights_reexport_only_the_unet(sd15_export, sd15_main_fields, tiny_model_dir,
                                                      write_engines_yaml, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("sd15", controlnet=True), model)
    shutil.copytree(load_engines_file(sd15_export.config).workspace, tmp_path / "build")
    config = write_engines_yaml(tmp_path, model, "sd15", **sd15_main_fields(model))
    before = _snapshot(_onnx_dir(config))
    _perturb(model / "unet" / "diffusion_pytorch_model.safetensors", "conv_out.bias", shift=0.01)

    report = api.export(config)
    assert {r.group.component: r.cached for r in report.results} == {
        "text_encoder": True, "unet": False, "vae_encoder": True, "vae_decoder": True, "controlnet": True}
    after = _snapshot(_onnx_dir(config))
    assert all(after[path] == stat for path, stat in before.items())  # nothing else rewritten (old UNet kept)
    new_unet = report.results[1].artifact.path
    assert new_unet.parent == _onnx_dir(config) and not any(p.is_relative_to(new_unet) for p in before)


@pytest.mark.slow  # an fp16 VAE export and its parity check (about 13 s)
def test_fp16_vae_overflow_fails_the_export(tiny_model_dir, write_engines_yaml, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("sd15"), model)
    _perturb(model / "vae" / "diffusion_pytorch_model.safetensors", "decoder.conv_out.weight", scale=3e5)
    config = write_engines_yaml(tmp_path, model, "sd15", components=["vae_decoder"],
                                precision={"vae_decoder": "fp16"})
    message = r"sd15-tiny\.vae_decoder\.fp16: .*\n  output 'images' at .*float16 overflow"
    with pytest.raises(ExportError, match=message):
        api.export(config)
    assert list(_onnx_dir(config).iterdir()) == []  # nothing shipped, nothing left behind


CHILD = """
import sys, time
from pathlib import Path
from trt_diffusion import api
from trt_diffusion.workspace import store

def stall(writer):  # every output written, manifest not yet: the moment a naive cache would trust
    Path(sys.argv[2]).write_text(str(writer.path))
    time.sleep(600)

store._commit = stall
api.export(sys.argv[1], component="text_encoder")
"""


@pytest.mark.slow  # an export killed in a subprocess, then a full one (~12 s)
def test_killed_export_leaves_nothing_trusted_and_the_next_run_completes(tiny_model_dir, write_engines_yaml, tmp_path):
    config = write_engines_yaml(tmp_path, tiny_model_dir("sd15"), "sd15", components=["text_encoder"],
                                precision={"text_encoder": "fp32"})
    marker = tmp_path / "stalled"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(config), str(marker)], cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            if child.poll() is not None:
                pytest.fail(f"the child exited early: {child.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the child never reached the commit")
            time.sleep(0.1)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    temp = Path(marker.read_text())
    assert temp.name.startswith(TEMP_PREFIX) and (temp / "model.onnx").is_file()  # killed mid-write
    onnx_dir = _onnx_dir(config)
    assert [p for p in onnx_dir.iterdir() if not p.name.startswith(TEMP_PREFIX)] == []

    report = api.export(config)
    (result,) = report.results
    assert not result.cached and all(c["passed"] for c in result.parity)
    assert not temp.exists()  # the interrupted write was cleaned up
    assert sorted(p.name for p in onnx_dir.iterdir()) == [result.artifact.path.name]
