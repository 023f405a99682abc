"""A refit map's ONNX identity is onnx_facts.onnx_sha256, the build's one hash (no caching twin): an ONNX replaced by
another of the same size and mtime (a copy that keeps times, `cp -p`, rsync) is a different file, and the map
refuses it; a missing one is a RefitError."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from trt_diffusion.errors import RefitError
from trt_diffusion.lora.refit_map import RefitMap
from trt_diffusion.onnx_facts import onnx_sha256


def _write_onnx(path: Path, value: float) -> None:
    weight = numpy_helper.from_array(np.full((4,), value, dtype=np.float32), "weight")
    graph = helper.make_graph([helper.make_node("Add", ["x", "weight"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])], [weight])
    onnx.save(helper.make_model(graph), str(path))


def test_a_same_size_same_mtime_replacement_is_refused(tmp_path):
    onnx_path = tmp_path / "model.onnx"
    _write_onnx(onnx_path, 1.0)
    refit_map = RefitMap(onnx_sha256=onnx_sha256(onnx_path), targets={}, onnx_file="model.onnx")
    refit_map.check_onnx(onnx_path)  # the very file: accepted (and its digest cached)

    stat = onnx_path.stat()
    other = tmp_path / "other.onnx"
    _write_onnx(other, 2.0)
    assert other.stat().st_size == stat.st_size and other.read_bytes() != onnx_path.read_bytes()
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(other, onnx_path)  # same path, size and mtime; another inode and other weights
    with pytest.raises(RefitError, match="built for another ONNX"):
        refit_map.check_onnx(onnx_path)


def test_a_missing_onnx_is_a_refit_error(tmp_path):
    with pytest.raises(RefitError, match="ONNX file not found"):
        RefitMap(onnx_sha256="0" * 64, targets={}).check_onnx(tmp_path / "gone.onnx")
