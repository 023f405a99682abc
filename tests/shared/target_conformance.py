"""What every target promises, written once (as diffusers composes tester mixins): a built engine is found
and runs at its shape, a second build reuses it untouched, a tampered or changed engine is rebuilt, and a
build killed before it publishes leaves nothing trusted.

Use: `class TestMyTarget(TargetConformance): target_name = "mine"` (and `child_setup`, Python run in the
child process of the kill test before building, when the target is registered at run time).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
from trt_diffusion.targets import BuildRequest, get_target

SHAPE = (2, 4, 8, 8)


class Tiny(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, sample):
        x = self.conv(sample).permute(0, 2, 3, 1)
        return self.proj(x).permute(0, 3, 1, 2)


def export_tiny(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    batch, h, w = torch.export.Dim("batch", max=8), torch.export.Dim("h", max=64), torch.export.Dim("w", max=64)
    torch.onnx.export(Tiny(seed).eval(), (torch.randn(*SHAPE),), str(path), input_names=["sample"],
                      output_names=["noise_pred"], dynamo=True, optimize=False,
                      dynamic_shapes={"sample": {0: batch, 2: h, 3: w}})
    return path


def make_spec(target: str) -> EngineSpec:
    return EngineSpec(model="m", family="sd15", source="local:x", component="unet", target=target,
                      precision="fp32", batch=2, bucket=Bucket.static(Size(64, 64)))


def _payload(path: Path) -> Path:
    """The largest file of an engine (a folder or a single file): what tampering corrupts."""
    if path.is_file():
        return path
    return max((p for p in path.rglob("*") if p.is_file() and "manifest" not in p.name), key=lambda p: p.stat().st_size)


def _tree_state(path: Path) -> dict[str, int]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): p.stat().st_mtime_ns for p in files}


class TargetConformance:
    target_name: str = ""
    child_setup: str = ""  # Python run in the kill test's child process first (registers run-time targets)

    @pytest.fixture
    def target(self):
        target = get_target(self.target_name)
        reason = target.unavailable_reason()
        if reason is not None:
            pytest.skip(f"the {self.target_name} target is not available here: {reason}")
        return target

    @pytest.fixture(scope="class")
    def onnx_files(self, tmp_path_factory):
        root = tmp_path_factory.mktemp("conformance-onnx")
        return export_tiny(root / "a" / "tiny.onnx", seed=0), export_tiny(root / "b" / "tiny.onnx", seed=1)

    def request(self, workspace: Path, onnx_path: Path) -> BuildRequest:
        return BuildRequest(spec=make_spec(self.target_name), onnx_path=onnx_path,
                            profile={"sample": (SHAPE, SHAPE, SHAPE)}, workspace=workspace,
                            timing_cache_dir=workspace / "timing-cache")

    def test_built_engine_is_found_and_matches_torch(self, target, tmp_path, onnx_files):
        path, cached = target.build(self.request(tmp_path, onnx_files[0]))
        assert not cached and path.exists()
        engine = target.find(tmp_path, make_spec(self.target_name))
        assert engine is not None and engine.path == path
        x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
        out = target.runner(engine).run({"sample": x})["noise_pred"]
        expected = Tiny(0).eval()(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(out, expected, atol=1e-4)

    def test_second_build_reuses_the_engine_untouched(self, target, tmp_path, onnx_files):
        request = self.request(tmp_path, onnx_files[0])
        path, _ = target.build(request)
        before = _tree_state(path)
        assert target.is_current(request)
        again, cached = target.build(request)
        assert cached and again == path and _tree_state(path) == before

    def test_tampered_engine_is_not_trusted(self, target, tmp_path, onnx_files):
        request = self.request(tmp_path, onnx_files[0])
        path, _ = target.build(request)
        with open(_payload(path), "ab") as handle:
            handle.write(b"\0")
        assert not target.is_current(request)
        _, cached = target.build(request)
        assert not cached and target.is_current(request)

    def test_changed_source_rebuilds(self, target, tmp_path, onnx_files):
        target.build(self.request(tmp_path, onnx_files[0]))
        changed = self.request(tmp_path, onnx_files[1])
        assert not target.is_current(changed)
        _, cached = target.build(changed)
        assert not cached

    def test_killed_build_leaves_nothing_trusted(self, target, tmp_path, onnx_files):
        """SIGKILL at the moment the build would publish (its first rename): nothing is trusted after, and
        the next build completes."""
        script = textwrap.dedent(self.child_setup) + textwrap.dedent(f"""
            import os, signal
            from pathlib import Path
            from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
            from trt_diffusion.targets import BuildRequest, get_target

            def die(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            os.rename = os.replace = die  # every target publishes by renaming into place
            shape = {SHAPE!r}
            spec = EngineSpec(model="m", family="sd15", source="local:x", component="unet",
                              target={self.target_name!r}, precision="fp32", batch=2,
                              bucket=Bucket.static(Size(64, 64)))
            workspace = Path({str(tmp_path)!r})
            get_target({self.target_name!r}).build(BuildRequest(
                spec=spec, onnx_path=Path({str(onnx_files[0])!r}), profile={{"sample": (shape, shape, shape)}},
                workspace=workspace, timing_cache_dir=workspace / "timing-cache"))
        """)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                          os.environ.get("PYTHONPATH")]))}
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
        assert result.returncode == -9, result.stderr
        request = self.request(tmp_path, onnx_files[0])
        assert target.find(tmp_path, request.spec) is None or not target.is_current(request)
        _, cached = target.build(request)
        assert not cached and target.is_current(request)
