"""TensorRT build decisions, checked on CPU: profiles, flags, Q/DQ detection, manifests,
compatibility, paths, input and refit checks, and the target module without TensorRT."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
from trt_diffusion.errors import BuildError, ConfigError, MissingDependencyError, RefitError, RuntimeInputError
from trt_diffusion.onnx_facts import (
    check_profile_against_inputs,
    onnx_compute_dtype,
    onnx_has_qdq,
    onnx_input_shapes,
    onnx_sha256,
    read_base_weights,
    validate_profile,
)
from trt_diffusion.targets.tensorrt import builder, host_probe
from trt_diffusion.targets.tensorrt.build_flags import GIB, BuildFlags, network_creation_flags
from trt_diffusion.targets.tensorrt.feeds import check_feeds
from trt_diffusion.targets.tensorrt.host_gates import check_engine_compatible, check_hardware
from trt_diffusion.targets.tensorrt.manifest import (
    REBUILD_COMMAND,
    EngineManifest,
    RefitRecord,
    engine_path,
    manifest_is_current,
    manifest_path,
)
from trt_diffusion.targets.tensorrt.precision import check_onnx_precision
from trt_diffusion.targets.tensorrt.refit_weights import prepare_refit_weights, weights_for_refit
from trt_diffusion.targets.tensorrt.timing_cache import timing_cache_lock, timing_cache_path
from trt_diffusion.targets.tensorrt.versions import versions_compatible
from trt_diffusion.tensors import TensorSpec

STATIC_512 = Bucket.static(Size(512, 512))
RANGE_512_1024 = Bucket(Size(512, 512), Size(768, 768), Size(1024, 1024))


def make_spec(precision="fp16", refittable=False, bucket=STATIC_512, batch=2, options=None) -> EngineSpec:
    options = {"tensorrt_optimization_level": 3, "tensorrt_workspace_gb": 8, **(options or {})}
    return EngineSpec(
        model="sd15-tiny", family="sd15", source="models/tiny-sd15", component="unet", target="tensorrt",
        precision=precision, batch=batch, bucket=bucket, refittable=refittable,
        build_options=tuple(sorted(options.items())),
    )


def sd15_unet_profile(bucket: Bucket, batch: int, timestep_shape=None) -> dict:
    """What the component layer hands over for an SD1.5 UNet (latent factor 8, CLIP 77x768)."""
    def sample(size: Size):
        height, width = size.latent(8)
        return (batch, 4, height, width)

    timestep = (batch,) if timestep_shape is None else timestep_shape
    return {
        "sample": (sample(bucket.min), sample(bucket.opt), sample(bucket.max)),
        "timestep": (timestep, timestep, timestep),
        "encoder_hidden_states": ((batch, 77, 768),) * 3,
    }


# ---------------------------------------------------------------------------------------------
# tiny ONNX files
# ---------------------------------------------------------------------------------------------


def conv_model(dynamic: bool = True) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    batch, height, width = ("batch", "height", "width") if dynamic else (2, 8, 8)
    weight = numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32), "conv.weight")
    bias = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "conv.bias")
    shape = numpy_helper.from_array(np.array([0, 8, -1], dtype=np.int64), "reshape.shape")
    nodes = [
        helper.make_node("Conv", ["sample", "conv.weight", "conv.bias"], ["h"], pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["h", "reshape.shape"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "tiny_conv",
        [helper.make_tensor_value_info("sample", TensorProto.FLOAT, [batch, 4, height, width])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, 8, "tokens" if dynamic else 64])],
        initializer=[weight, bias, shape],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def qdq_model() -> onnx.ModelProto:
    """x -> Q -> DQ -> Conv(DQ(int8 weight)): explicit int8 quantization as ModelOpt writes it."""
    rng = np.random.default_rng(1)
    initializers = [
        numpy_helper.from_array(np.array(0.05, dtype=np.float32), "x.scale"),
        numpy_helper.from_array(np.array(0, dtype=np.int8), "x.zero_point"),
        numpy_helper.from_array(rng.integers(-127, 128, (8, 4, 3, 3)).astype(np.int8), "conv.weight_q"),
        numpy_helper.from_array(np.array(0.01, dtype=np.float32), "w.scale"),
        numpy_helper.from_array(np.array(0, dtype=np.int8), "w.zero_point"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["sample", "x.scale", "x.zero_point"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x.scale", "x.zero_point"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["conv.weight_q", "w.scale", "w.zero_point"], ["w_dq"]),
        helper.make_node("Conv", ["x_dq", "w_dq"], ["out"], pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes, "tiny_qdq",
        [helper.make_tensor_value_info("sample", TensorProto.FLOAT, [2, 4, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 8, 8, 8])],
        initializer=initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def trt_fp8_model() -> onnx.ModelProto:
    """ModelOpt's FP8 export before the rewrite: nodes in the `trt` domain."""
    scale = numpy_helper.from_array(np.array(0.1, dtype=np.float32), "scale")
    nodes = [
        helper.make_node("TRT_FP8QuantizeLinear", ["sample", "scale"], ["q"], domain="trt"),
        helper.make_node("TRT_FP8DequantizeLinear", ["q", "scale"], ["out"], domain="trt"),
    ]
    graph = helper.make_graph(
        nodes, "tiny_fp8",
        [helper.make_tensor_value_info("sample", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4])],
        initializer=[scale],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("trt", 1)])


def save(model: onnx.ModelProto, path: Path, external: bool = False) -> Path:
    onnx.save(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
              location=f"{path.name}.data", size_threshold=0)
    return path


@pytest.fixture
def conv_onnx(tmp_path) -> Path:
    onnx.checker.check_model(conv_model())
    return save(conv_model(), tmp_path / "conv.onnx")


@pytest.fixture
def qdq_onnx(tmp_path) -> Path:
    onnx.checker.check_model(qdq_model())
    return save(qdq_model(), tmp_path / "qdq.onnx")


# ---------------------------------------------------------------------------------------------
# profiles
# ---------------------------------------------------------------------------------------------


def test_static_bucket_with_cfg_batch_gives_min_opt_max_equal():
    shapes = validate_profile(sd15_unet_profile(STATIC_512, batch=2))
    assert shapes == {
        "sample": ((2, 4, 64, 64), (2, 4, 64, 64), (2, 4, 64, 64)),
        "timestep": ((2,), (2,), (2,)),
        "encoder_hidden_states": ((2, 77, 768), (2, 77, 768), (2, 77, 768)),
    }


def test_range_bucket_spans_min_to_max_latents():
    shapes = validate_profile(sd15_unet_profile(RANGE_512_1024, batch=2))
    assert shapes["sample"] == ((2, 4, 64, 64), (2, 4, 96, 96), (2, 4, 128, 128))
    assert shapes["encoder_hidden_states"] == ((2, 77, 768),) * 3


def test_scalar_timestep_and_lists_are_accepted_as_tuples():
    raw = sd15_unet_profile(STATIC_512, batch=2, timestep_shape=())
    raw["sample"] = [list(s) for s in raw["sample"]]  # as it comes back from JSON
    shapes = validate_profile(raw)
    assert shapes["timestep"] == ((), (), ())
    assert shapes["sample"] == ((2, 4, 64, 64),) * 3


def test_profile_with_min_above_opt_names_input_and_dim():
    bad = sd15_unet_profile(RANGE_512_1024, batch=2)
    bad["sample"] = ((2, 4, 128, 128), (2, 4, 96, 96), (2, 4, 128, 128))
    with pytest.raises(BuildError, match=r"input 'sample': dim 2 needs min <= opt <= max, got 128, 96, 128"):
        validate_profile(bad)


def test_profile_problems_are_all_listed():
    bad = {
        "sample": ((2, 4, 64), (2, 4, 64, 64), (2, 4, 64, 64)),
        "timestep": ((0,), (1,), (1,)),
    }
    with pytest.raises(BuildError) as raised:
        validate_profile(bad)
    message = str(raised.value)
    assert "input 'sample': min, opt and max have different ranks" in message
    assert "input 'timestep': dim 0 has min 0" in message


def test_profile_must_fit_the_onnx_inputs(conv_onnx):
    inputs = onnx_input_shapes(conv_onnx)
    assert inputs == {"sample": (-1, 4, -1, -1)}  # initializers are not inputs
    check_profile_against_inputs(validate_profile({"sample": ((1, 4, 8, 8), (2, 4, 16, 16), (4, 4, 32, 32))}), inputs)

    with pytest.raises(BuildError, match=r"input 'sample' has dynamic shape \(-1, 4, -1, -1\) but no"):
        check_profile_against_inputs({}, inputs)
    with pytest.raises(BuildError, match=r"does not have: \['timestep'\]"):
        check_profile_against_inputs({"sample": ((1, 4, 8, 8),) * 3, "timestep": ((1,),) * 3}, inputs)
    with pytest.raises(BuildError, match=r"static dims \(-1, 4, -1, -1\) at dim\(s\) \[1\]"):
        check_profile_against_inputs({"sample": ((1, 3, 8, 8),) * 3}, inputs)
    with pytest.raises(BuildError, match=r"has rank 3"):
        check_profile_against_inputs({"sample": ((1, 4, 8),) * 3}, inputs)


def test_static_onnx_input_needs_no_profile(tmp_path):
    path = save(conv_model(dynamic=False), tmp_path / "static.onnx")
    check_profile_against_inputs({}, onnx_input_shapes(path))


# ---------------------------------------------------------------------------------------------
# Q/DQ detection and flags
# ---------------------------------------------------------------------------------------------


def test_qdq_detection(conv_onnx, qdq_onnx, tmp_path):
    assert onnx_has_qdq(conv_onnx) is False
    assert onnx_has_qdq(qdq_onnx) is True
    assert onnx_has_qdq(save(trt_fp8_model(), tmp_path / "fp8.onnx")) is True


def test_qdq_detection_does_not_read_external_data(tmp_path):
    path = save(qdq_model(), tmp_path / "qdq_ext.onnx", external=True)
    (tmp_path / "qdq_ext.onnx.data").unlink()  # a multi-GB file it must not need
    assert onnx_has_qdq(path) is True


def test_missing_or_corrupt_onnx_is_a_build_error(tmp_path):
    with pytest.raises(BuildError, match="not found"):
        onnx_has_qdq(tmp_path / "absent.onnx")
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07not a model")
    with pytest.raises(BuildError, match="could not read ONNX"):
        onnx_has_qdq(corrupt)


def test_every_precision_builds_strongly_typed_without_precision_flags(conv_onnx, qdq_onnx):
    """Precision comes from the ONNX: no spec sets a builder precision flag, on TensorRT 10 or 11."""
    for precision, onnx_path in [("fp32", conv_onnx), ("fp16", conv_onnx), ("bf16", conv_onnx),
                                 ("fp8", qdq_onnx), ("int8", qdq_onnx)]:
        flags = BuildFlags.for_spec(make_spec(precision), onnx_has_qdq(onnx_path))
        assert flags == BuildFlags(precision=precision, tf32=True, strongly_typed=True, refit=False, strip_plan=False,
                                   version_compatible=False, builder_optimization_level=3, workspace_bytes=8 * GIB)
        assert flags.builder_flags() == ()
        assert flags.cleared_builder_flags() == ()
    refit = BuildFlags.for_spec(make_spec("fp16", refittable=True, options={"tensorrt_tf32": False,
                                                                            "tensorrt_version_compatible": True}), False)
    assert refit.builder_flags() == ("REFIT", "VERSION_COMPATIBLE")
    assert refit.cleared_builder_flags() == ("TF32",)


def test_network_is_created_strongly_typed_on_10_and_by_default_on_11():
    assert network_creation_flags("10.8.0.43") == ("STRONGLY_TYPED",)
    assert network_creation_flags("10.13.3.9") == ("STRONGLY_TYPED",)
    assert network_creation_flags("11.0.0.114") == ()  # always strongly typed; the flag is deprecated there
    assert network_creation_flags("11.4.1") == ()


def test_the_onnx_dtype_must_be_the_engines_precision(tmp_path):
    """Strong typing: an fp16 engine from an fp32 graph would silently be an fp32 engine."""
    check_onnx_precision(make_spec("fp32"), "float32")
    check_onnx_precision(make_spec("fp16"), "float16")
    check_onnx_precision(make_spec("bf16"), "bfloat16")
    check_onnx_precision(make_spec("int8"), "float16")  # Q/DQ over the fp16 graph
    check_onnx_precision(make_spec("fp8"), "float16")
    check_onnx_precision(make_spec("fp16"), None)  # no float weights at all
    with pytest.raises(BuildError, match="a fp16 TensorRT engine is built strongly typed from an float16 ONNX, but "
                                         "this ONNX's weights are float32"):
        check_onnx_precision(make_spec("fp16"), "float32")
    with pytest.raises(BuildError, match="Q/DQ ONNX over the fp16 graph, but this ONNX's weights are float32"):
        check_onnx_precision(make_spec("int8"), "float32")
    with pytest.raises(BuildError, match="weights are float16"):
        check_onnx_precision(make_spec("bf16"), "float16")

    fp16 = conv_model()
    for tensor in fp16.graph.initializer:
        if tensor.data_type == TensorProto.FLOAT:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name))
    assert onnx_compute_dtype(save(conv_model(), tmp_path / "fp32.onnx")) == "float32"
    assert onnx_compute_dtype(save(fp16, tmp_path / "fp16.onnx", external=True)) == "float16"
    assert onnx_compute_dtype(save(qdq_model(), tmp_path / "qdq.onnx")) == "float32"  # its fp32 scales


def test_hardware_gate_names_engine_precision_and_gpu():
    check_hardware(make_spec("fp8"), (8, 9), "NVIDIA L40S")
    check_hardware(make_spec("fp8"), (9, 0), "NVIDIA H100")
    check_hardware(make_spec("bf16"), (8, 0), "NVIDIA A100")
    for precision in ("fp32", "fp16", "int8"):
        check_hardware(make_spec(precision), (7, 5), "Tesla T4")
    spec = make_spec("fp8")
    with pytest.raises(BuildError) as raised:
        check_hardware(spec, (8, 6), "NVIDIA RTX A6000")
    assert str(raised.value).startswith(f"{spec.name}: precision fp8 needs a GPU of compute capability 8.9 or newer; "
                                        "this host's GPU is NVIDIA RTX A6000 (sm_86, compute capability 8.6)")
    with pytest.raises(BuildError, match=r"precision bf16 needs a GPU of compute capability 8.0 .* Tesla T4 \(sm_75"):
        check_hardware(make_spec("bf16"), (7, 5), "Tesla T4")


def test_refittable_spec_sets_refit():
    assert BuildFlags.for_spec(make_spec("fp16", refittable=True), False).refit is True
    assert BuildFlags.for_spec(make_spec("fp16", refittable=False), False).refit is False


def test_precision_and_qdq_must_agree(qdq_onnx):
    with pytest.raises(BuildError, match="precision fp8 needs an ONNX with Q/DQ nodes"):
        BuildFlags.for_spec(make_spec("fp8"), False)
    with pytest.raises(BuildError, match="carries Q/DQ nodes but the engine's precision is fp16"):
        BuildFlags.for_spec(make_spec("fp16"), onnx_has_qdq(qdq_onnx))
    # fp8/int8 engines refit (LoRA'd weights with recomputed weight scales: tests/lora/test_quantized_refit.py)
    assert BuildFlags.for_spec(make_spec("int8", refittable=True), True).refit is True
    with pytest.raises(ConfigError, match="unknown precision 'fp4'"):  # typed specs: refused when made
        BuildFlags.for_spec(make_spec("fp4"), False)


def test_build_options_reach_the_flags():
    spec = make_spec("fp32", options={"tensorrt_optimization_level": 5, "tensorrt_workspace_gb": 2.5,
                                      "tensorrt_tf32": False})
    flags = BuildFlags.for_spec(spec, False)
    assert flags.builder_optimization_level == 5
    assert flags.workspace_bytes == int(2.5 * GIB)
    assert flags.tf32 is False
    defaults = BuildFlags.for_spec(make_spec("fp32", options={}), False)
    assert (defaults.builder_optimization_level, defaults.workspace_bytes) == (3, 8 * GIB)


def test_bad_build_options_are_refused():
    with pytest.raises(BuildError, match="tensorrt_optimization_level must be an integer from 0 to 5, got 7"):
        BuildFlags.for_spec(make_spec(options={"tensorrt_optimization_level": 7}), False)
    with pytest.raises(BuildError, match="tensorrt_workspace_gb must be a positive number"):
        BuildFlags.for_spec(make_spec(options={"tensorrt_workspace_gb": 0}), False)


def test_onnxruntime_spec_is_not_a_tensorrt_build():
    spec = EngineSpec(**{**make_spec().__dict__, "target": "onnxruntime"})
    with pytest.raises(BuildError, match="target is 'onnxruntime'"):
        BuildFlags.for_spec(spec, False)


# ---------------------------------------------------------------------------------------------
# timing cache, paths, manifest
# ---------------------------------------------------------------------------------------------


def test_timing_cache_is_keyed_on_the_full_trt_version_and_the_device(tmp_path):
    assert timing_cache_path(tmp_path, (9, 0), "10.13.0.35", "NVIDIA H100 80GB HBM3") == (
        tmp_path / "sm90-nvidia-h100-80gb-hbm3-trt10.13.0.35.timing.cache")
    # combine() needs the exact build: another build number is another cache
    assert timing_cache_path(tmp_path, (9, 0), "10.13.0.36", "NVIDIA H100 80GB HBM3") != (
        timing_cache_path(tmp_path, (9, 0), "10.13.0.35", "NVIDIA H100 80GB HBM3"))
    # set_timing_cache() rejects another device's cache, even of the same compute capability
    assert timing_cache_path(tmp_path, (8, 9), "10.13.0.35", "NVIDIA L40S") != (
        timing_cache_path(tmp_path, (8, 9), "10.13.0.35", "NVIDIA GeForce RTX 4090"))
    assert timing_cache_path(tmp_path, (10, 0), "11.0.0", "NVIDIA B200").name == "sm100-nvidia-b200-trt11.0.0.timing.cache"
    with pytest.raises(BuildError, match="not a TensorRT version"):
        timing_cache_path(tmp_path, (9, 0), "latest", "NVIDIA H100")


def test_timing_cache_lock_excludes_threads_of_one_process(tmp_path):
    """fcntl locks belong to the process: without the in-process lock two threads would both hold it."""
    import threading
    import time

    cache = tmp_path / "cache" / "sm90-x-trt10.13.0.35.timing.cache"
    inside, overlaps, start = [], [], threading.Barrier(4)

    def job(index: int) -> None:
        start.wait()
        for _ in range(5):
            with timing_cache_lock(cache):
                inside.append(index)
                if len(inside) > 1:
                    overlaps.append(tuple(inside))
                time.sleep(0.002)
                inside.remove(index)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert overlaps == []
    assert (cache.parent / (cache.name + ".lock")).is_file()
    # another path has its own lock: holding one does not block the other
    with timing_cache_lock(cache):
        with timing_cache_lock(tmp_path / "other.timing.cache"):
            pass


def test_timing_cache_lock_excludes_other_processes(tmp_path):
    import subprocess
    import sys

    cache = tmp_path / "shared.timing.cache"
    code = ("import sys, fcntl; f = open(sys.argv[1], 'a+b'); "
            "fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)")
    with timing_cache_lock(cache):
        held = subprocess.run([sys.executable, "-c", code, str(cache) + ".lock"], capture_output=True, timeout=60)
    assert held.returncode != 0 and b"BlockingIOError" in held.stderr
    free = subprocess.run([sys.executable, "-c", code, str(cache) + ".lock"], capture_output=True, timeout=60)
    assert free.returncode == 0


def test_engine_path_layout(tmp_path):
    spec = make_spec("fp16", bucket=RANGE_512_1024)
    plan = engine_path(tmp_path / "build", spec)
    assert plan == tmp_path / "build" / "engines" / "tensorrt" / f"sd15-tiny.unet.512x512-1024x1024.b2.fp16.{spec.key}.plan"
    assert manifest_path(plan) == plan.with_name(f"sd15-tiny.unet.512x512-1024x1024.b2.fp16.{spec.key}.manifest.json")
    assert engine_path(tmp_path, make_spec("fp32")) != engine_path(tmp_path, spec)


def make_manifest(**changes) -> EngineManifest:
    spec = make_spec("fp16", refittable=True)
    fields = dict(
        spec_key=spec.key,
        spec_name=spec.name,
        tensorrt_version="10.8.0.43",
        compute_capability=(8, 9),
        device_name="NVIDIA L40S",
        flags=BuildFlags.for_spec(spec, False).to_dict(),
        profile_shapes=validate_profile(sd15_unet_profile(STATIC_512, 2)),
        onnx_sha256="ab" * 32,
        inputs=(
            TensorSpec(name="sample", dtype="float16", shape=(-1, 4, -1, -1)),
            TensorSpec(name="timestep", dtype="float16", shape=(-1,)),
            TensorSpec(name="encoder_hidden_states", dtype="float16", shape=(-1, 77, 768)),
        ),
        outputs=(TensorSpec(name="out_sample", dtype="float16", shape=(-1, 4, -1, -1)),),
        refit_map="refit/unet.json",
        plan_bytes=1234,
        build_seconds=12.5,
    )
    return EngineManifest(**{**fields, **changes})


def test_manifest_round_trip(tmp_path):
    manifest = make_manifest()
    assert EngineManifest.from_json(manifest.to_json()) == manifest
    raw = json.loads(manifest.to_json())
    assert raw["schema_version"] == 3 and raw["target"] == "tensorrt" and raw["refit"] is None
    assert raw["profile_shapes"]["sample"] == [[2, 4, 64, 64]] * 3
    assert raw["flags"]["refit"] is True and raw["created_at"].endswith("+00:00")

    path = tmp_path / "engines" / "x.manifest.json"
    manifest.write(path)
    assert EngineManifest.read(path) == manifest
    assert [p.name for p in path.parent.iterdir()] == ["x.manifest.json"]  # no temporary left behind


def test_unreadable_manifests_are_build_errors(tmp_path):
    with pytest.raises(BuildError, match="is missing: rebuild with"):
        EngineManifest.read(tmp_path / "absent.manifest.json")
    with pytest.raises(BuildError, match="not valid JSON"):
        EngineManifest.from_json("{")
    older = json.loads(make_manifest().to_json()) | {"schema_version": 1}  # v1 did not record refits: never trusted
    with pytest.raises(BuildError, match="schema_version 1; this trt-diffusion reads 3"):
        EngineManifest.from_json(json.dumps(older))
    broken = json.loads(make_manifest().to_json())
    del broken["onnx_sha256"]
    with pytest.raises(BuildError, match="malformed"):
        EngineManifest.from_json(json.dumps(broken))


def test_manifest_is_current_only_for_identical_inputs():
    manifest = make_manifest()
    spec = make_spec("fp16", refittable=True)
    flags = BuildFlags.for_spec(spec, False)
    profile = sd15_unet_profile(STATIC_512, 2)
    args = dict(manifest=manifest, spec=spec, onnx_digest="ab" * 32, flags=flags, profile_shapes=profile,
                trt_version="10.8.0.43", compute_capability=(8, 9))
    assert manifest_is_current(**args)
    assert not manifest_is_current(**{**args, "onnx_digest": "cd" * 32})
    assert not manifest_is_current(**{**args, "trt_version": "10.8.1"})
    assert not manifest_is_current(**{**args, "compute_capability": (9, 0)})
    assert not manifest_is_current(**{**args, "spec": make_spec("fp16", refittable=False)})
    refitted = manifest.model_copy(update={"refit": RefitRecord(weights_sha256="ef" * 32, names=("conv.weight",))})
    assert not manifest_is_current(**{**args, "manifest": refitted})  # a LoRA'd plan is not the built engine


# ---------------------------------------------------------------------------------------------
# compatibility
# ---------------------------------------------------------------------------------------------


def test_engine_from_other_trt_and_gpu_is_refused_with_both_named():
    with pytest.raises(BuildError) as raised:
        check_engine_compatible(make_manifest(), "10.13.0.35", (9, 0), "NVIDIA H100")
    message = str(raised.value)
    assert "was built with TensorRT 10.8.0.43 for sm_89 (NVIDIA L40S)" in message
    assert "this host has TensorRT 10.13.0.35 and sm_90 (NVIDIA H100)" in message
    assert "exact TensorRT version (major.minor.patch)" in message
    assert "compute capability" in message
    assert f"`{REBUILD_COMMAND}`" in message


def test_compatibility_is_exact_to_the_patch():
    manifest = make_manifest(tensorrt_version="10.13.0.35", compute_capability=(9, 0))
    check_engine_compatible(manifest, "10.13.0.35", (9, 0))
    check_engine_compatible(manifest, "10.13.0.36", (9, 0))  # the build number is not part of the version
    with pytest.raises(BuildError, match=r"TensorRT 10.13.1 and sm_90: a TensorRT engine loads only"):
        check_engine_compatible(manifest, "10.13.1", (9, 0))
    with pytest.raises(BuildError, match="sm_89") as raised:
        check_engine_compatible(manifest, "10.13.0.35", (8, 9))
    assert "exact TensorRT version" not in str(raised.value)  # only the GPU differs


def test_version_compatible_engines_accept_newer_runtimes_of_the_same_major_and_10_on_11():
    flags = BuildFlags.for_spec(make_spec(options={"tensorrt_version_compatible": True}), False)
    manifest = make_manifest(tensorrt_version="10.8.0.43", compute_capability=(9, 0), flags=flags.to_dict())
    check_engine_compatible(manifest, "10.8.0.43", (9, 0))
    check_engine_compatible(manifest, "10.13.0.35", (9, 0))
    check_engine_compatible(manifest, "11.0.0.114", (9, 0))  # support matrix: TensorRT 10 VC engines on 11
    check_engine_compatible(manifest, "11.4.1", (9, 0))
    with pytest.raises(BuildError, match="version-compatible engine loads only on the TensorRT version it was built "
                                         "with or a newer one of the same major"):
        check_engine_compatible(manifest, "10.7.0", (9, 0))
    with pytest.raises(BuildError, match="version-compatible engine"):
        check_engine_compatible(manifest, "12.0.0", (9, 0))  # no other cross-major pair is supported
    eleven = make_manifest(tensorrt_version="11.1.0", compute_capability=(9, 0), flags=flags.to_dict())
    check_engine_compatible(eleven, "11.4.0", (9, 0))
    with pytest.raises(BuildError, match="version-compatible engine"):
        check_engine_compatible(eleven, "10.13.0.35", (9, 0))  # never onto an older runtime
    with pytest.raises(BuildError, match="version-compatible engine"):
        check_engine_compatible(eleven, "11.0.0", (9, 0))


def test_version_matrix():
    cases = [  # (built, runtime, version_compatible) -> loads
        ("10.8.0", "10.8.0.43", False, True), ("10.8.0", "10.8.1", False, False), ("10.8.0", "11.0.0", False, False),
        ("10.8.0", "10.13.0", True, True), ("10.13.0", "10.8.0", True, False), ("10.8.0", "11.3.0", True, True),
        ("11.0.0", "10.16.1", True, False), ("11.0.0", "12.0.0", True, False), ("8.6.1", "10.8.0", True, False),
    ]
    assert [versions_compatible(b, r, vc) for b, r, vc, _ in cases] == [ok for *_, ok in cases]


# ---------------------------------------------------------------------------------------------
# run-time inputs and refit weights
# ---------------------------------------------------------------------------------------------


def unet_feeds(batch=2, size=64, dtype=np.float16):
    return {
        "sample": np.zeros((batch, 4, size, size), dtype),
        "timestep": np.zeros((batch,), dtype),
        "encoder_hidden_states": np.zeros((batch, 77, 768), dtype),
    }


def test_feeds_inside_the_profile_pass():
    check_feeds(make_manifest(), unet_feeds())
    ranged = make_manifest(profile_shapes=validate_profile(sd15_unet_profile(RANGE_512_1024, 2)))
    check_feeds(ranged, unet_feeds(size=96))


def test_wrong_feeds_list_every_problem_and_the_expected_inputs():
    feeds = unet_feeds(size=96)
    feeds["timestep"] = feeds["timestep"].astype(np.float32)
    del feeds["encoder_hidden_states"]
    feeds["controlnet_cond"] = np.zeros(1)
    with pytest.raises(RuntimeInputError) as raised:
        check_feeds(make_manifest(), feeds)
    message = str(raised.value)
    assert "missing input(s): ['encoder_hidden_states']" in message
    assert "unexpected input(s): ['controlnet_cond']" in message
    assert "sample: shape (2, 4, 96, 96) is outside the engine's profile (2, 4, 64, 64)..(2, 4, 64, 64)" in message
    assert "timestep: dtype float32, expected float16" in message
    assert "expected:\n  sample: float16 (2, 4, 64, 64)\n  timestep: float16 (2,)" in message


def test_range_profile_listed_as_min_to_max():
    ranged = make_manifest(profile_shapes=validate_profile(sd15_unet_profile(RANGE_512_1024, 2)))
    with pytest.raises(RuntimeInputError, match=r"sample: float16 \(2, 4, 64, 64\)..\(2, 4, 128, 128\)"):
        check_feeds(ranged, unet_feeds(size=136))


def test_refit_weights_are_cast_to_the_engine_dtype_and_checked():
    prototypes = {"conv.weight": ("float32", 288), "conv.bias": ("float32", 8), "norm.weight": ("float8e4m3", 8),
                  "proj.weight": ("bfloat16", 4)}
    prepared = prepare_refit_weights("e", prototypes, {
        "conv.weight": np.ones((8, 4, 3, 3), np.float64)[..., ::-1],  # not contiguous
        "proj.weight": np.full((2, 2), 1.5, np.float32),
    })
    assert prepared["conv.weight"].dtype == np.float32 and prepared["conv.weight"].flags.c_contiguous
    assert prepared["proj.weight"].dtype.name == "bfloat16" and prepared["proj.weight"].nbytes == 8
    assert prepared["proj.weight"].astype(np.float32).tolist() == [[1.5, 1.5], [1.5, 1.5]]

    with pytest.raises(RefitError) as raised:
        prepare_refit_weights("e", {**prototypes, "extra": ("float32", -1)}, {
            "conv.bias": np.ones(9, np.float32),
            "extra": np.ones(1, np.float32),
            "norm.weight": np.ones(8, np.float32),
            "unknown": np.ones(1, np.float32),
        })
    message = str(raised.value)
    assert "conv.bias: 9 values (shape (9,)), the engine holds 8" in message
    assert "extra: the engine has no refittable weight of this name" in message
    assert "unknown: the engine has no refittable weight of this name" in message
    assert "norm.weight: the engine holds it as float8e4m3, which numpy cannot represent" in message


def test_a_later_refit_restores_what_an_earlier_one_changed():
    base = {"a": np.zeros(2), "b": np.zeros(2), "c": np.zeros(2)}
    lora_b = {"b": np.ones(2), "c": np.ones(2)}
    assert weights_for_refit("e", set(), lora_b, None).keys() == {"b", "c"}

    merged = weights_for_refit("e", {"a", "b"}, lora_b, base)  # LoRA A touched a and b
    assert merged.keys() == {"a", "b", "c"}
    assert merged["a"] is base["a"] and merged["b"] is lora_b["b"]

    with pytest.raises(RefitError, match=r"changed by an earlier refit are not in this one \(e.g. \['a'\]\)"):
        weights_for_refit("e", {"a", "b"}, lora_b, None)
    with pytest.raises(RefitError, match=r"the base weights lack \['a'\]"):
        weights_for_refit("e", {"a"}, lora_b, {"b": np.zeros(2)})


def test_base_weights_and_hash_follow_external_data(tmp_path):
    path = save(conv_model(), tmp_path / "conv_ext.onnx", external=True)
    weights = read_base_weights(path)
    assert set(weights) == {"conv.weight", "conv.bias"}  # floating-point initializers only
    expected = numpy_helper.to_array(conv_model().graph.initializer[0])
    np.testing.assert_array_equal(weights["conv.weight"], expected)
    assert set(read_base_weights(path, ["conv.bias"])) == {"conv.bias"}
    with pytest.raises(RefitError, match=r"no initializer\(s\) named \['lora.up'\]"):
        read_base_weights(path, ["lora.up"])

    digest = onnx_sha256(path)
    assert digest == onnx_sha256(path)
    data = tmp_path / "conv_ext.onnx.data"
    data.write_bytes(data.read_bytes()[:-4] + b"\x00\x00\x80\x3f")  # one weight changed, graph unchanged
    assert onnx_sha256(path) != digest
    data.unlink()
    with pytest.raises(BuildError, match="references external data 'conv_ext.onnx.data', which is missing"):
        onnx_sha256(path)


# ---------------------------------------------------------------------------------------------
# the TensorRT target on a host without TensorRT
# ---------------------------------------------------------------------------------------------


def _tensorrt_usable() -> bool:
    from trt_diffusion.targets.tensorrt.engine import tensorrt_available

    return tensorrt_available()[0]


needs_no_tensorrt = pytest.mark.skipif(_tensorrt_usable(), reason="this host has TensorRT and a GPU")


def test_target_module_imports_without_tensorrt():
    module = importlib.import_module("trt_diffusion.targets.tensorrt.engine")
    assert callable(module.build_engine)


@needs_no_tensorrt
def test_tensorrt_available_says_why_not():
    from trt_diffusion.targets.tensorrt.engine import host_info, tensorrt_available

    available, reason = tensorrt_available()
    assert available is False
    assert "tensorrt" in reason.lower() or "CUDA" in reason
    with pytest.raises(MissingDependencyError, match="pypi.nvidia.com"):
        host_info()


@needs_no_tensorrt
def test_build_checks_its_inputs_before_needing_tensorrt(conv_onnx, tmp_path):
    from trt_diffusion.targets.tensorrt.engine import build_engine

    good = {"sample": ((1, 4, 8, 8), (2, 4, 16, 16), (4, 4, 32, 32))}
    with pytest.raises(BuildError, match="dim 2 needs min <= opt <= max"):
        build_engine(conv_onnx, make_spec("fp16"), {"sample": ((1, 4, 8, 8), (2, 4, 4, 16), (4, 4, 32, 32))},
                     tmp_path / "e.plan", tmp_path / "cache")
    with pytest.raises(BuildError, match="precision int8 needs an ONNX with Q/DQ"):
        build_engine(conv_onnx, make_spec("int8"), good, tmp_path / "e.plan", tmp_path / "cache")
    with pytest.raises(BuildError, match="weights are float32"):
        build_engine(conv_onnx, make_spec("fp16"), good, tmp_path / "e.plan", tmp_path / "cache")
    with pytest.raises(MissingDependencyError):
        build_engine(conv_onnx, make_spec("fp32"), good, tmp_path / "e.plan", tmp_path / "cache")
    assert not (tmp_path / "e.plan").exists()


def write_plan_and_manifest(tmp_path: Path, manifest: EngineManifest) -> Path:
    plan = tmp_path / "engine.plan"
    plan.write_bytes(b"\0" * manifest.plan_bytes)
    manifest.write(manifest_path(plan))
    return plan


@needs_no_tensorrt
def test_load_checks_compatibility_before_deserializing(tmp_path):
    from trt_diffusion.targets.tensorrt.engine import load_engine

    plan = write_plan_and_manifest(tmp_path, make_manifest())
    with pytest.raises(BuildError, match="built with TensorRT 10.8.0.43 for sm_89"):
        load_engine(plan, host=("10.13.0.35", (9, 0), "NVIDIA H200"))
    with pytest.raises(MissingDependencyError):  # compatible: only now is TensorRT needed
        load_engine(plan, host=("10.8.0.43", (8, 9), "NVIDIA L40S"))
    plan.write_bytes(b"\0" * 10)
    with pytest.raises(BuildError, match="has 10 bytes, its manifest says 1234"):
        load_engine(plan, host=("10.8.0.43", (8, 9), "NVIDIA L40S"))
    manifest_path(plan).unlink()
    with pytest.raises(BuildError, match="manifest .* is missing"):
        load_engine(plan, host=("10.8.0.43", (8, 9), "NVIDIA L40S"))


@needs_no_tensorrt
def test_run_checks_feeds_before_loading(tmp_path):
    from trt_diffusion.targets.tensorrt.engine import run_engine

    plan = write_plan_and_manifest(tmp_path, make_manifest())
    with pytest.raises(RuntimeInputError, match="missing input"):
        run_engine(plan, {"sample": np.zeros((2, 4, 64, 64), np.float16)})


@needs_no_tensorrt
def test_hardware_gate_runs_before_tensorrt_is_started(monkeypatch, qdq_onnx, tmp_path):
    from trt_diffusion.targets.tensorrt import engine

    fp16_qdq = qdq_model()
    for tensor in fp16_qdq.graph.initializer:
        if tensor.data_type == TensorProto.FLOAT:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name))
    onnx_path = save(fp16_qdq, tmp_path / "fp16_qdq.onnx")
    monkeypatch.setattr(host_probe, "probe_cuda_device", lambda: (host_probe.CudaDevice((8, 6), "NVIDIA RTX A6000"), ()))
    started = []
    monkeypatch.setattr(host_probe, "require_tensorrt", lambda: started.append(True))
    profile = {"sample": ((2, 4, 8, 8),) * 3}
    with pytest.raises(BuildError, match="precision fp8 needs a GPU of compute capability 8.9"):
        engine.build_engine(onnx_path, make_spec("fp8"), profile, tmp_path / "e.plan", tmp_path / "cache")
    assert started == []  # refused before TensorRT was imported


def test_a_multi_gb_onnx_is_hashed_once_per_run(monkeypatch, tmp_path):
    """is_current and build_engine both need the digest, for every engine (one per shape) of one ONNX."""
    from trt_diffusion import onnx_facts

    path = save(conv_model(), tmp_path / "model.onnx", external=True)
    reads = []
    real = onnx_facts.update_digest
    monkeypatch.setattr(onnx_facts, "update_digest", lambda digest, file: (reads.append(Path(file).name), real(digest, file)))
    first = onnx_sha256(path)
    assert [onnx_sha256(path) for _ in range(5)] == [first] * 5
    assert reads == ["model.onnx", "model.onnx.data"]  # each file read once
    data = tmp_path / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:-4] + b"\x01\x02\x03\x04")  # same size, new content and mtime
    import os

    stat = data.stat()
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert onnx_sha256(path) != first
    assert reads[2:] == ["model.onnx", "model.onnx.data"]


# ---------------------------------------------------------------------------------------------- #27 item 6


@needs_no_tensorrt
def test_refittable_builds_are_refused_on_tensorrt_11_3_unless_waived(monkeypatch, tmp_path):
    """TensorRT 11.3 can drop a GEMM bias in REFIT engines: `build` refuses refittable specs there, before
    TensorRT starts, naming the known issue, unless engines.yaml sets build.tensorrt.allow_refit_on_11_3."""
    from types import SimpleNamespace

    import trt_diffusion.targets.tensorrt as trt_target
    from trt_diffusion.engines_file.schema import TensorRTSettings
    from trt_diffusion.targets.tensorrt import engine
    from trt_diffusion.targets.tensorrt.host_gates import check_refit_supported

    onnx_path = save(conv_model(), tmp_path / "conv.onnx")
    monkeypatch.setattr(builder, "check_can_build", lambda spec: None)
    monkeypatch.setattr(host_probe, "require_tensorrt", lambda: None)
    monkeypatch.setattr(host_probe, "host_info", lambda: ("11.3.0.7", (9, 0), "NVIDIA H200"))
    parsed = []
    monkeypatch.setattr(builder, "_parse_onnx", lambda *a: parsed.append(a) or pytest.fail("TensorRT was started"))
    profile = {"sample": ((2, 4, 8, 8),) * 3}
    with pytest.raises(BuildError, match=r"refused on TensorRT 11.3.0.7: .*drop the bias of a GEMM.*known issue"
                                         r".*allow_refit_on_11_3: true"):
        engine.build_engine(onnx_path, make_spec("fp32", refittable=True), profile, tmp_path / "e.plan",
                            tmp_path / "cache")
    assert parsed == []
    check_refit_supported(make_spec("fp32", refittable=False), "11.3.0.7")  # not refittable: built
    check_refit_supported(make_spec("fp32", refittable=True), "11.4.0.1")  # other releases: built
    check_refit_supported(make_spec("fp32", refittable=True), "10.13.0.35")
    # the waiver travels from engines.yaml to the spec's options (and only when set: default keys unchanged)
    options = trt_target.TensorRTTarget().build_options(
        SimpleNamespace(build=SimpleNamespace(tensorrt=TensorRTSettings(allow_refit_on_11_3=True))))
    check_refit_supported(make_spec("fp32", refittable=True, options=options), "11.3.0.7")
    default = trt_target.TensorRTTarget().build_options(SimpleNamespace(build=SimpleNamespace(
        tensorrt=TensorRTSettings())))
    assert set(default) == {"tensorrt_optimization_level"}  # no workspace cap by default (#45 item 10)
    chosen = trt_target.TensorRTTarget().build_options(SimpleNamespace(build=SimpleNamespace(
        tensorrt=TensorRTSettings(version_compatible=True, strip_plan=True, weight_streaming=True, tf32=False))))
    flags = BuildFlags.for_spec(make_spec("fp32", options=chosen), False)
    assert (flags.version_compatible, flags.strip_plan, flags.weight_streaming, flags.tf32) == (True, True, True, False)


def test_the_workspace_is_uncapped_by_default_and_an_explicit_cap_keeps_its_key(tmp_path, monkeypatch):
    """#45 item 10: the builder's WORKSPACE pool was capped at 8 GiB by default (demo/Diffusion sets no cap), which
    can exclude the large attention tactics of Wan 720p or 2K FLUX. No cap by default now; an engines.yaml that
    sets workspace_gb keeps exactly the build option, so its engines keep their keys."""
    import sys
    from types import SimpleNamespace

    from trt_diffusion.engines_file.schema import TensorRTSettings
    from trt_diffusion.targets.tensorrt import target as trt_target

    def options(**settings):
        return trt_target.TensorRTTarget().build_options(
            SimpleNamespace(build=SimpleNamespace(tensorrt=TensorRTSettings(**settings))))

    assert "tensorrt_workspace_gb" not in options()
    assert options(workspace_gb=8)["tensorrt_workspace_gb"] == 8.0  # as every engine's options said before
    spec = make_spec("fp32", options={})
    uncapped = EngineSpec(**{**spec.__dict__, "build_options": (("tensorrt_optimization_level", 3),)})
    assert BuildFlags.for_spec(uncapped, False).workspace_bytes is None
    assert BuildFlags.for_spec(spec, False).workspace_bytes == 8 * GIB
    limits = []
    config = SimpleNamespace(set_flag=lambda flag: None, clear_flag=lambda flag: None,
                             set_memory_pool_limit=lambda pool, size: limits.append((pool, size)),
                             create_timing_cache=lambda data: object(), set_timing_cache=lambda c, ignore_mismatch: True,
                             builder_optimization_level=0)
    fake_builder = SimpleNamespace(create_builder_config=lambda: config)
    module = SimpleNamespace(MemoryPoolType=SimpleNamespace(WORKSPACE="WORKSPACE"),
                             BuilderFlag=SimpleNamespace(TF32="TF32"))
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    builder._create_config(fake_builder, BuildFlags.for_spec(uncapped, False), [], tmp_path / "cache", "unet")
    assert limits == []
    builder._create_config(fake_builder, BuildFlags.for_spec(spec, False), [], tmp_path / "cache", "unet")
    assert limits == [("WORKSPACE", 8 * GIB)]
