"""The onnxruntime target: an engine per shape that runs at its shape, rejects others, and is rebuilt
only when its inputs change."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.targets.onnxruntime import engine as ort_target
from trt_diffusion.targets.onnxruntime.runner import load_runner


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, sample):
        x = self.conv(sample).permute(0, 2, 3, 1)
        return self.proj(x).permute(0, 3, 1, 2)


@pytest.fixture(scope="module")
def dynamic_onnx(tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    batch, h, w = torch.export.Dim("batch", max=8), torch.export.Dim("h", max=64), torch.export.Dim("w", max=64)
    torch.onnx.export(Tiny().eval(), (torch.randn(2, 4, 8, 8),), str(path), input_names=["sample"],
                      output_names=["noise_pred"], dynamo=True, optimize=False,
                      dynamic_shapes={"sample": {0: batch, 2: h, 3: w}})
    return path


def spec(size=64, batch=2, refittable=False) -> EngineSpec:
    return EngineSpec(model="m", family="sd15", source="local:x", component="unet", target="onnxruntime",
                      precision="fp32", batch=batch, bucket=Bucket.static(Size(size, size)), refittable=refittable)


def profile(latent=8, batch=2):
    shape = (batch, 4, latent, latent)
    return {"sample": (shape, shape, shape)}


@pytest.mark.parametrize("refittable", [False, True])
def test_engine_runs_at_its_shape_and_matches_torch(tmp_path, dynamic_onnx, refittable):
    folder, manifest, cached = ort_target.build_engine(dynamic_onnx, spec(refittable=refittable), profile(), tmp_path)
    assert not cached and manifest.static_shapes
    assert manifest.inputs[0].shape == (2, 4, 8, 8)
    assert manifest.offline_optimization == (None if refittable else "extended")
    runner = load_runner(folder)
    x = np.random.default_rng(0).standard_normal((2, 4, 8, 8)).astype(np.float32)
    out = runner.run({"sample": x})["noise_pred"]
    expected = Tiny().eval()(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_engine_rejects_another_shape_with_a_clear_error(tmp_path, dynamic_onnx):
    folder, _, _ = ort_target.build_engine(dynamic_onnx, spec(), profile(), tmp_path)
    runner = load_runner(folder)
    with pytest.raises(RuntimeInputError, match=r"sample: shape \[2, 4, 16, 16\], expected float32\[2,4,8,8\]"):
        runner.run({"sample": np.zeros((2, 4, 16, 16), np.float32)})


def test_second_build_is_cached_and_untouched(tmp_path, dynamic_onnx):
    folder, _, _ = ort_target.build_engine(dynamic_onnx, spec(), profile(), tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    again, _, cached = ort_target.build_engine(dynamic_onnx, spec(), profile(), tmp_path)
    assert cached and again == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_tampered_engine_is_not_trusted(tmp_path, dynamic_onnx):
    folder, _, _ = ort_target.build_engine(dynamic_onnx, spec(), profile(), tmp_path)
    with open(folder / "model.onnx", "ab") as f:
        f.write(b"\0")
    _, _, cached = ort_target.build_engine(dynamic_onnx, spec(), profile(), tmp_path)
    assert not cached


def test_killed_build_leaves_no_trusted_engine(tmp_path, dynamic_onnx):
    """SIGKILL while the engine is being written: the next run finds nothing to trust and rebuilds."""
    script = textwrap.dedent(f"""
        import os, signal, onnx
        from trt_diffusion.targets.onnxruntime import engine as t
        from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
        real = t._optimize_offline
        def dying(source, target, *disabled):
            real(source, target, *disabled)
            os.kill(os.getpid(), signal.SIGKILL)  # after the model is written, before the manifest
        t._optimize_offline = dying
        spec = EngineSpec(model="m", family="sd15", source="local:x", component="unet", target="onnxruntime",
                          precision="fp32", batch=2, bucket=Bucket.static(Size(64, 64)))
        shape = (2, 4, 8, 8)
        t.build_engine({str(dynamic_onnx)!r}, spec, {{"sample": (shape, shape, shape)}}, {str(tmp_path)!r})
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert result.returncode == -9
    final = ort_target.engine_dir(tmp_path, spec())
    assert not final.exists()  # only a temp folder was left
    _, _, cached = ort_target.build_engine(dynamic_onnx, spec(), profile(), tmp_path)
    assert not cached
    leftovers = [p for p in final.parent.iterdir() if p.name.startswith(".")]
    assert leftovers  # the dead build's temp folder: ignored, never trusted


def test_sessions_sleep_between_runs(tmp_path, dynamic_onnx):
    # a pipeline runs its sessions one after another: a session's workers spinning after its run took the cores the
    # next session's run needed (docs/benchmarks.md, first-block caching: 1.14x -> 1.02x a full step)
    folder, _, _ = ort_target.build_engine(dynamic_onnx, spec(), profile(), tmp_path)
    options = load_runner(folder).session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
