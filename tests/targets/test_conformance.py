"""The conformance suite (tests/shared/target_conformance.py) for every target the project ships: a target
that cannot run here (tensorrt without TensorRT and a GPU) skips with its reason."""

from __future__ import annotations

from target_conformance import TargetConformance


class TestOnnxRuntimeConformance(TargetConformance):
    target_name = "onnxruntime"


class TestTensorRTConformance(TargetConformance):
    target_name = "tensorrt"


class TestOpenVINOConformance(TargetConformance):
    target_name = "openvino"
