"""Build targets: turn an exported ONNX into one engine per EngineSpec.

`tensorrt_config` holds everything about a TensorRT build that can be decided and tested without
TensorRT (flags, profiles, manifests, compatibility, paths); `tensorrt_target` is the only module in
the project that imports `tensorrt`, and does so lazily so that importing it never needs a GPU.
"""
