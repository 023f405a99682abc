"""Runners (torch reference, ONNX Runtime, TensorRT) and the denoising pipeline over them."""
