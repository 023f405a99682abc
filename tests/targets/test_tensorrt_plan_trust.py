"""Plan integrity (#27 item 4, with the plan sha256 and host-code gate of #32 finding 4), on CPU.

A plan is trusted by the sha256 its manifest records, not by a flag and a file size: `is_current`, `find`,
packaging and loading check it; TensorRT's `engine_host_code_allowed` (a version-compatible plan runs the lean
runtime it embeds) is enabled only for a plan whose bytes match a verified manifest whose spec asks for
`tensorrt_version_compatible`; a manifest that says a refit is in progress is never loaded for inference;
`refit` refuses a fresh export that is not the ONNX the plan was built from.
"""

from __future__ import annotations

import hashlib
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import trt_diffusion.targets.tensorrt as trt_target
from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
from trt_diffusion.errors import BuildError, RefitError
from trt_diffusion.onnx_facts import onnx_sha256, validate_profile
from trt_diffusion.targets.base import BuildRequest, BuiltEngine
from trt_diffusion.targets.tensorrt import engine as trt_engine
from trt_diffusion.targets.tensorrt import host_probe, plan_load, trt_log
from trt_diffusion.targets.tensorrt import refit as trt_refit
from trt_diffusion.targets.tensorrt.build_flags import BuildFlags
from trt_diffusion.targets.tensorrt.manifest import EngineManifest, RefitRecord, engine_path, manifest_path
from trt_diffusion.tensors import TensorSpec

HOST = ("10.13.0.35", (9, 0), "NVIDIA H200")
PROFILE = {"sample": ((1, 4, 8, 8),) * 3}


def spec(version_compatible: bool = False, refittable: bool = False) -> EngineSpec:
    options = {"tensorrt_version_compatible": True} if version_compatible else {}
    return EngineSpec(model="m", family="sd15", source="s", component="unet", target="tensorrt", precision="fp32",
                      batch=1, bucket=Bucket.static(Size(64, 64)), refittable=refittable,
                      build_options=tuple(sorted(options.items())))


def tiny_onnx(path: Path, value: float = 1.0) -> Path:
    weight = numpy_helper.from_array(np.full((4, 4, 1, 1), value, np.float32), "conv.weight")
    graph = helper.make_graph([helper.make_node("Conv", ["sample", "conv.weight"], ["out"])], "g",
                              [helper.make_tensor_value_info("sample", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 8, 8])],
                              initializer=[weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def built(tmp_path: Path, the_spec: EngineSpec, onnx_path: Path, plan: bytes = b"PLAN" * 64) -> Path:
    """A plan and manifest as `build_engine` leaves them."""
    path = engine_path(tmp_path, the_spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(plan)
    EngineManifest(
        spec_key=the_spec.key, spec_name=the_spec.name, tensorrt_version=HOST[0], compute_capability=HOST[1],
        device_name=HOST[2], flags=BuildFlags.for_spec(the_spec, False).to_dict(),
        profile_shapes=validate_profile(PROFILE), onnx_sha256=onnx_sha256(onnx_path),
        inputs=(TensorSpec(name="sample", dtype="float32", shape=(1, 4, 8, 8)),),
        outputs=(TensorSpec(name="out", dtype="float32", shape=(1, 4, 8, 8)),),
        plan_bytes=len(plan), plan_sha256=hashlib.sha256(plan).hexdigest(), build_seconds=0.1,
    ).write(manifest_path(path))
    return path


def tamper(path: Path) -> None:
    """Same size, other bytes (and a later mtime): what a size check cannot see."""
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def host(monkeypatch):
    monkeypatch.setattr(host_probe, "host_info", lambda device_index=0: HOST)


class FakeRuntime:
    """`tensorrt.Runtime` as far as loading goes: records whether host code was allowed at deserialization."""

    seen: list[bool] = []

    def __init__(self, logger):
        self.engine_host_code_allowed = False

    def deserialize_cuda_engine(self, plan):
        FakeRuntime.seen.append(self.engine_host_code_allowed)
        return types.SimpleNamespace(plan=bytes(plan))


@pytest.fixture
def fake_runtime(monkeypatch):
    module = types.ModuleType("tensorrt")
    module.__version__, module.Builder, module.Runtime = HOST[0], object, FakeRuntime
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    monkeypatch.setattr(trt_log, "trt_logger", lambda: None)
    FakeRuntime.seen = []
    return FakeRuntime


def test_is_current_and_find_refuse_a_plan_whose_bytes_changed(tmp_path, host):
    the_spec, onnx_path = spec(), tiny_onnx(tmp_path / "model.onnx")
    plan = built(tmp_path, the_spec, onnx_path)
    request = BuildRequest(spec=the_spec, onnx_path=onnx_path, workspace=tmp_path, profile=PROFILE,
                           timing_cache_dir=tmp_path / "cache")
    target = trt_target.TensorRTTarget()
    assert target.is_current(request) and target.find(tmp_path, the_spec) is not None
    tamper(plan)
    assert not target.is_current(request)  # rebuilt, not reused
    assert target.find(tmp_path, the_spec) is None  # never served
    with pytest.raises(BuildError, match="sha256"):
        target.triton_model(BuiltEngine(the_spec, plan, EngineManifest.read(manifest_path(plan))),
                            engine_backend="tensorrt")


def test_host_code_only_for_a_verified_version_compatible_plan(tmp_path, fake_runtime):
    onnx_path = tiny_onnx(tmp_path / "model.onnx")
    compatible, plain = spec(version_compatible=True), spec()
    plan = built(tmp_path, compatible, onnx_path)
    trt_engine.load_engine(plan, host=HOST, spec=compatible)
    trt_engine.load_engine(built(tmp_path, plain, onnx_path), host=HOST, spec=plain)
    assert fake_runtime.seen == [True, False]
    tamper(plan)  # a planted plan beside a manifest that says version_compatible
    with pytest.raises(BuildError, match="sha256"):
        trt_engine.load_engine(plan, host=HOST, spec=compatible)
    assert fake_runtime.seen == [True, False]  # refused before TensorRT saw it


def test_host_code_needs_the_spec_to_ask_for_it(tmp_path, fake_runtime):
    """A manifest edited to say version_compatible, with the plan's digest re-recorded: the spec decides."""
    onnx_path = tiny_onnx(tmp_path / "model.onnx")
    plain = spec()
    plan = built(tmp_path, plain, onnx_path)
    manifest = EngineManifest.read(manifest_path(plan))
    manifest.model_copy(update={"flags": {**manifest.flags, "version_compatible": True}}).write(manifest_path(plan))
    trt_engine.load_engine(plan, host=HOST, spec=plain)
    assert fake_runtime.seen == [False]


def test_a_manifest_with_a_refit_in_progress_is_never_loaded(tmp_path, fake_runtime):
    onnx_path = tiny_onnx(tmp_path / "model.onnx")
    the_spec = spec(refittable=True)
    plan = built(tmp_path, the_spec, onnx_path)
    manifest = EngineManifest.read(manifest_path(plan))
    pending = RefitRecord(weights_sha256="ab" * 32, names=("conv.weight",), in_progress=True)
    manifest.model_copy(update={"refit": pending}).write(manifest_path(plan))
    with pytest.raises(BuildError, match="refit .*interrupted"):
        trt_engine.load_engine(plan, host=HOST, spec=the_spec)
    assert fake_runtime.seen == []


def test_refit_refuses_a_fresh_export_that_is_not_the_plans_onnx(tmp_path, monkeypatch):
    onnx_path = tiny_onnx(tmp_path / "model.onnx")
    the_spec = spec(refittable=True)
    plan = built(tmp_path, the_spec, onnx_path)
    other = tiny_onnx(tmp_path / "other.onnx", value=2.0)  # the model changed since the build
    loads = []
    monkeypatch.setattr(plan_load, "load_engine", lambda *a, **k: loads.append(a) or pytest.fail("loaded"))
    lora = types.ModuleType("trt_diffusion.lora")
    lora.RefitMap = types.SimpleNamespace(load=lambda path, onnx_path: None)
    lora.refit_weights_for_tensorrt = lambda refit_map, weights, precision: dict(weights)
    monkeypatch.setitem(sys.modules, "trt_diffusion.lora", lora)
    engine = BuiltEngine(the_spec, plan, EngineManifest.read(manifest_path(plan)))
    with pytest.raises(RefitError, match="not the ONNX .* built from"):
        trt_target.TensorRTTarget().refit(engine, None, lambda: other)
    assert loads == []


# ---------------------------------------------------------------------------------------------- streamed loading


class StreamingRuntime(FakeRuntime):
    """deserialize_cuda_engine(IStreamReaderV2) as the binding drives it: read(num_bytes, stream) until the plan is
    in; `overwrite` rewrites the file in place after the first chunk (what the second hash must catch)."""

    chunks: list[int] = []
    overwrite: Path | None = None

    def deserialize_cuda_engine(self, plan):
        if not hasattr(plan, "read"):
            return super().deserialize_cuda_engine(plan)
        FakeRuntime.seen.append(self.engine_host_code_allowed)
        data = b""
        while True:
            chunk = plan.read(1 << 30, 0)
            if not chunk:
                break
            StreamingRuntime.chunks.append(len(chunk))
            data += bytes(chunk)
            if StreamingRuntime.overwrite is not None:
                with open(StreamingRuntime.overwrite, "r+b") as handle:
                    handle.seek(len(data))
                    handle.write(b"\xff")
                StreamingRuntime.overwrite = None
        return types.SimpleNamespace(plan=data)


@pytest.fixture
def streaming_runtime(monkeypatch, fake_runtime):
    from trt_diffusion.targets.tensorrt import plan_stream

    module = sys.modules["tensorrt"]
    module.Runtime = StreamingRuntime
    module.IStreamReaderV2 = type("IStreamReaderV2", (), {"__init__": lambda self: None})
    module.SeekPosition = types.SimpleNamespace(SET="SET", CUR="CUR", END="END")
    monkeypatch.setattr(plan_stream, "CHUNK_BYTES", 100)
    StreamingRuntime.chunks, StreamingRuntime.overwrite = [], None
    return StreamingRuntime


def test_a_streamed_load_reads_the_verified_plan_in_chunks(tmp_path, streaming_runtime):
    onnx_path = tiny_onnx(tmp_path / "model.onnx")
    the_spec = spec()
    plan = built(tmp_path, the_spec, onnx_path, plan=bytes(range(256)) * 4)
    engine = trt_engine.load_engine(plan, host=HOST, spec=the_spec, stream=True)
    assert engine.engine.plan == plan.read_bytes()
    assert max(streaming_runtime.chunks) <= 100 and sum(streaming_runtime.chunks) == 1024  # never the whole plan
    tamper(plan)
    with pytest.raises(BuildError, match="sha256"):
        trt_engine.load_engine(plan, host=HOST, spec=the_spec, stream=True)
    assert streaming_runtime.seen == [False]  # refused before TensorRT read a byte


def test_a_plan_rewritten_in_place_while_it_streams_is_dropped(tmp_path, streaming_runtime):
    onnx_path = tiny_onnx(tmp_path / "model.onnx")
    the_spec = spec()
    plan = built(tmp_path, the_spec, onnx_path, plan=bytes(range(256)) * 4)
    streaming_runtime.overwrite = plan
    with pytest.raises(BuildError, match="changed while it was being loaded"):
        trt_engine.load_engine(plan, host=HOST, spec=the_spec, stream=True)


def test_host_code_plans_stream_only_when_nobody_else_can_rewrite_them(tmp_path):
    from trt_diffusion.targets.tensorrt.plan_stream import load_mode, privately_writable

    gib = 1 << 30
    assert load_mode(10 * gib, host_code=False, private=False) == "stream"
    assert load_mode(10 * gib, host_code=True, private=True) == "stream"
    assert load_mode(10 * gib, host_code=True, private=False) == "memory"  # verified bytes in memory instead
    assert load_mode(100 << 20, host_code=False, private=True) == "memory"  # small plans: one read
    path = tmp_path / "p.plan"
    path.write_bytes(b"x")
    path.chmod(0o644)
    assert privately_writable(path)
    path.chmod(0o664)
    assert not privately_writable(path)


# ---------------------------------------------------------------------------------------------- stripped plans


def test_a_stripped_plan_loads_only_with_the_onnx_it_was_built_from(tmp_path, fake_runtime, monkeypatch):
    onnx_path = tiny_onnx(tmp_path / "model.onnx")
    stripped = spec()
    stripped = EngineSpec(**{**stripped.__dict__, "build_options": (("tensorrt_strip_plan", True),)})
    flags = BuildFlags.for_spec(stripped, False)
    assert flags.strip_plan and {"STRIP_PLAN", "REFIT_IDENTICAL"} <= set(flags.builder_flags())
    plan = built(tmp_path, stripped, onnx_path)
    refits = []
    monkeypatch.setattr(trt_refit, "refit_from_base", lambda engine, onnx, weights=None: refits.append(onnx))
    with pytest.raises(BuildError, match="stripped plan .*weights_onnx"):
        trt_engine.load_engine(plan, host=HOST, spec=stripped)
    trt_engine.load_engine(plan, host=HOST, spec=stripped, weights_onnx=onnx_path)
    assert refits == [onnx_path]
    with pytest.raises(RefitError, match="not the ONNX the plan was built from"):
        trt_engine.load_engine(plan, host=HOST, spec=stripped, weights_onnx=tiny_onnx(tmp_path / "b.onnx", 3.0))


class SeekingRuntime(StreamingRuntime):
    """Reads out of order, as nothing forbids TensorRT to (the reader exposes seek): the first 100 bytes, a jump past
    the next 100, the rest, then back for the skipped part."""

    def deserialize_cuda_engine(self, plan):
        if not hasattr(plan, "read"):
            return super().deserialize_cuda_engine(plan)
        FakeRuntime.seen.append(self.engine_host_code_allowed)

        def read_all(limit=None):
            data = b""
            while limit is None or len(data) < limit:
                chunk = bytes(plan.read(min(1 << 30, (limit or 1 << 30) - len(data)), 0))
                if not chunk:
                    break
                data += chunk
            return data

        head = read_all(100)
        assert plan.seek(100, "CUR") and plan.seek(-10, "END") and plan.seek(200, "SET")
        tail = read_all()
        assert plan.seek(100, "SET")
        middle = read_all(100)
        if StreamingRuntime.overwrite is not None:
            with open(StreamingRuntime.overwrite, "r+b") as handle:
                handle.seek(50)
                handle.write(b"\xff")
            StreamingRuntime.overwrite = None
            assert plan.seek(50, "SET") and read_all(10) == b""  # read again from disk, changed: nothing handed out
        return types.SimpleNamespace(plan=head + middle + tail)


def test_a_streamed_load_in_any_read_and_seek_order_is_accepted_and_a_change_still_caught(tmp_path, streaming_runtime,
                                                                                         monkeypatch):
    """#45 item 6: the stream was accepted only if TensorRT read it exactly once front to back; a seek past bytes
    read later failed every such load with "changed while loading". Each chunk is now checked when read again, in
    any order."""
    monkeypatch.setattr(sys.modules["tensorrt"], "Runtime", SeekingRuntime)
    onnx_path = tiny_onnx(tmp_path / "model.onnx")
    the_spec = spec()
    plan = built(tmp_path, the_spec, onnx_path, plan=bytes(range(256)) * 4)
    engine = trt_engine.load_engine(plan, host=HOST, spec=the_spec, stream=True)
    assert engine.engine.plan == plan.read_bytes()
    StreamingRuntime.overwrite = plan
    with pytest.raises(BuildError, match="changed while it was being loaded"):
        trt_engine.load_engine(plan, host=HOST, spec=the_spec, stream=True)


def test_a_chunk_source_refuses_seeks_outside_the_plan():
    import io

    from trt_diffusion.targets.tensorrt.plan_stream import ChunkSource

    data = bytes(range(250))
    digests = [hashlib.sha256(data[i:i + 100]).digest() for i in range(0, 250, 100)]
    source = ChunkSource(io.BytesIO(data), digests, len(data), chunk_bytes=100)
    assert not source.seek(251, 0) and not source.seek(-1, 0) and source.seek(-50, 2)
    assert source.read(1000) == data[200:] and source.read(10) == b"" and source.verdict()
