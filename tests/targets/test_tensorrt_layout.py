"""engine_layout decisions (#27 design gap 1), pure: which specs share one multi-profile engine, the GPU memory of
each layout (what `plan` shows), which profile a request runs in, and the envelope a manifest records."""

from __future__ import annotations

import pytest

from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, LoraVariant, Size
from trt_diffusion.targets.tensorrt.layout import layout_memory, profile_envelope, profile_groups, select_profile

GB = 1 << 30


def spec(size: int, batch: int, lora: str | None = None, precision: str = "fp16") -> EngineSpec:
    variant = LoraVariant(lora, ((lora, f"file:{lora}.safetensors", 1.0),)) if lora else None
    return EngineSpec(model="sdxl", family="sdxl", source="models/sdxl", component="unet", target="tensorrt",
                      precision=precision, batch=batch, bucket=Bucket.static(Size(size, size)), lora_variant=variant)


def test_specs_that_differ_only_in_shape_share_one_engine():
    shapes = [spec(s, b) for s in (768, 1024, 1152) for b in (2, 4)]
    groups = profile_groups([*shapes, spec(1024, 2, lora="style"), spec(1024, 2, precision="fp8")])
    assert [len(g.specs) for g in groups] == [6, 1, 1]  # a LoRA variant and another precision: weights of their own
    assert groups[0].specs == tuple(shapes) and groups[0].name == "sdxl.unet.fp16.6profiles"


def test_plan_memory_per_shape_and_with_profiles():
    """The issue's example: 6 SDXL UNet shapes of ~5 GB fp16 weights each."""
    memory = layout_memory([spec(s, b) for s in (768, 1024, 1152) for b in (2, 4)], 5 * GB)
    assert (memory.engines_per_shape, memory.engines_profiles) == (6, 1)
    assert (memory.per_shape_bytes, memory.profiles_bytes, memory.saved_bytes) == (30 * GB, 5 * GB, 25 * GB)


def test_the_tightest_profile_that_holds_the_request_is_chosen():
    profiles = [{"sample": ((1, 4, 64, 64), (2, 4, 96, 96), (4, 4, 128, 128))},
                {"sample": ((2, 4, 128, 128),) * 3},
                {"sample": ((1, 4, 96, 96), (1, 4, 96, 96), (1, 4, 96, 96))}]
    assert select_profile(profiles, {"sample": (2, 4, 128, 128)}) == 1  # the static one over the range
    assert select_profile(profiles, {"sample": (1, 4, 96, 96)}) == 2
    assert select_profile(profiles, {"sample": (3, 4, 64, 80)}) == 0
    assert select_profile(profiles, {"sample": (8, 4, 64, 64)}) is None
    assert select_profile(profiles, {"sample": (2, 4, 64)}) is None  # wrong rank


def test_the_envelope_spans_every_profile():
    profiles = [{"x": ((2, 8), (2, 8), (2, 8))}, {"x": ((1, 16), (1, 32), (4, 64))}]
    assert profile_envelope(profiles) == {"x": ((1, 8), (2, 8), (4, 64))}


def test_a_feed_inside_the_envelope_but_no_profile_is_refused_before_loading():
    import numpy as np

    from trt_diffusion.errors import RuntimeInputError
    from trt_diffusion.targets.tensorrt.feeds import check_feeds
    from trt_diffusion.targets.tensorrt.manifest import EngineManifest
    from trt_diffusion.tensors import TensorSpec

    profiles = ({"x": ((2, 8), (2, 8), (2, 8))}, {"x": ((1, 16), (1, 32), (1, 64))})
    manifest = EngineManifest(spec_key="k", spec_name="m", tensorrt_version="10.13.0", compute_capability=(9, 0),
                              device_name="gpu", flags={}, profile_shapes=profile_envelope(profiles),
                              profiles=profiles, onnx_sha256="0" * 64,
                              inputs=(TensorSpec(name="x", dtype="float32", shape=(-1, -1)),), outputs=(),
                              plan_bytes=1, build_seconds=0)
    check_feeds(manifest, {"x": np.zeros((1, 40), np.float32)})
    with pytest.raises(RuntimeInputError, match="fit none of the engine's 2 profiles"):
        check_feeds(manifest, {"x": np.zeros((2, 40), np.float32)})


def test_plan_shows_both_layouts_device_memory(tmp_path, tiny_sd15_dir, write_engines_yaml, capsys):
    """`plan` on a TensorRT file: per-shape engines hold a weight copy each, `profiles` one per weight set."""
    import json

    from trt_diffusion.cli import main

    path = write_engines_yaml(tmp_path, tiny_sd15_dir, "sd15", targets=["tensorrt"], buckets=["64x64", "128x128"],
                              batch=[1, 2])
    assert main(["plan", str(path), "--json"]) == 0
    rows = {row["component"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    unet = rows["unet"]["layouts"]
    assert unet["per_shape_engines"] == 4 and unet["profiles_engines"] == 1  # 2 buckets x 2 batch shapes
    assert unet["per_shape_bytes"] == 4 * unet["profiles_bytes"] > 0
    assert main(["plan", str(path)]) == 0
    assert "unet (tensorrt) device weights: per_shape" in capsys.readouterr().out
