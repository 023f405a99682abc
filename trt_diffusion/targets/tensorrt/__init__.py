"""The `tensorrt` target: one strongly typed `.plan` per EngineSpec, refittable for LoRAs.

`config.py` holds every decision that needs no TensorRT (flags, profiles, manifests, compatibility,
refit bookkeeping) and is tested on CPU; `engine.py` is the only module of trt-diffusion that imports
`tensorrt`, inside functions, so importing this package needs neither TensorRT nor a GPU. The target class is
`target.py`.
"""

from .target import OPTIONAL_SETTINGS, TensorRTTarget

__all__ = ["OPTIONAL_SETTINGS", "TensorRTTarget"]
