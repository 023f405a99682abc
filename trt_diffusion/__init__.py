"""trt-diffusion: diffusers models to verified inference engines behind Triton."""

__version__ = "0.1.0"
