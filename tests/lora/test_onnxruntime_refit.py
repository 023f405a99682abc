"""Refit on the onnxruntime target: LoRA outputs equal diffusers' fused model; switching leaves no residue."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trt_diffusion.errors import RefitError
from trt_diffusion.lora import (
    OnnxRuntimeRefitter,
    apply_refit_onnxruntime,
    build_refit_map,
    lora_deltas,
    refit_weights_for_tensorrt,
    restore_base,
)

ORT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def dynamo_map(dynamo_onnx, base_unet):
    return build_refit_map(dynamo_onnx, base_unet)


@pytest.fixture(scope="module")
def inputs(base_unet, helpers):
    return helpers.unet_inputs(base_unet)


@pytest.fixture(scope="module")
def refitter(dynamo_onnx, dynamo_map, base_unet):
    return OnnxRuntimeRefitter(dynamo_onnx, dynamo_map, base_unet)


def _run(session, inputs) -> np.ndarray:
    return session.run(None, inputs)[0]


def test_base_session_matches_torch(refitter, base_unet, inputs, helpers):
    expected = helpers.torch_output(base_unet, inputs)
    np.testing.assert_allclose(_run(refitter.restore_base(), inputs), expected, rtol=0, atol=ORT_TOLERANCE)


@pytest.mark.parametrize("loras", [[("a", 1.0)], [("b", 1.0)], [("a", 0.8), ("b", -0.5)]], ids=["A", "B", "A+B"])
def test_refit_matches_torch_with_the_lora_fused(refitter, base_unet, inputs, helpers, lora_a, lora_b, loras):
    files = {"a": lora_a, "b": lora_b}
    loras = [(files[name], scale) for name, scale in loras]
    expected = helpers.torch_output(helpers.fused_with_diffusers(base_unet, loras), inputs)
    refitted = _run(refitter.apply(loras), inputs)
    np.testing.assert_allclose(refitted, expected, rtol=0, atol=ORT_TOLERANCE)
    # the check can fail: the LoRA moves the output far beyond the tolerance
    assert np.abs(expected - helpers.torch_output(base_unet, inputs)).max() > 100 * ORT_TOLERANCE


def test_switching_a_b_a_is_bit_exact(refitter, inputs, lora_a, lora_b):
    first_a = _run(refitter.apply([(lora_a, 1.0)]), inputs)
    b = _run(refitter.apply([(lora_b, 1.0)]), inputs)
    again_a = _run(refitter.apply([(lora_a, 1.0)]), inputs)
    assert not np.array_equal(first_a, b)
    assert np.array_equal(first_a, again_a)
    assert refitter.loras == ((str(lora_a), 1.0),)


def test_scale_zero_and_restore_are_the_base_exactly(refitter, inputs, lora_a):
    base = _run(refitter.restore_base(), inputs)
    assert refitter.loras == ()
    assert np.array_equal(_run(refitter.apply([(lora_a, 0.0)]), inputs), base)
    refitter.apply([(lora_a, 1.0)])
    assert np.array_equal(_run(refitter.restore_base(), inputs), base)


def test_failed_switch_keeps_the_current_session(refitter, inputs, lora_a, rewrite_lora):
    session = refitter.apply([(lora_a, 1.0)])
    broken = rewrite_lora(lora_a, lambda s: {k.replace("to_k", "to_kk"): v for k, v in s.items()}, "broken-switch")
    with pytest.raises(RefitError, match="match no weight"):
        refitter.apply([(broken, 1.0)])
    assert refitter.session is session and refitter.loras == ((str(lora_a), 1.0),)


def test_refit_through_transposed_initializers_of_a_legacy_export(legacy_onnx, base_unet, inputs, helpers, lora_a):
    refit_map = build_refit_map(legacy_onnx, base_unet)
    weights = lora_deltas(base_unet, [(lora_a, 1.0)])
    assert all(refit_map.targets[name].transpose for name in weights)
    session = apply_refit_onnxruntime(legacy_onnx, refit_map, weights)
    expected = helpers.torch_output(helpers.fused_with_diffusers(base_unet, [(lora_a, 1.0)]), inputs)
    np.testing.assert_allclose(_run(session, inputs), expected, rtol=0, atol=ORT_TOLERANCE)
    # After the refit, the base again: torch's base output, which the LoRA is far from (so this can fail)
    base = helpers.torch_output(base_unet, inputs)
    np.testing.assert_allclose(_run(restore_base(legacy_onnx), inputs), base, rtol=0, atol=ORT_TOLERANCE)
    assert np.abs(expected - base).max() > 100 * ORT_TOLERANCE


def test_map_of_another_onnx_is_refused(legacy_onnx, dynamo_map, base_unet, lora_a):
    with pytest.raises(RefitError, match="built for another ONNX"):
        apply_refit_onnxruntime(legacy_onnx, dynamo_map, lora_deltas(base_unet, [(lora_a, 1.0)]))
    with pytest.raises(RefitError, match="built for another ONNX"):
        OnnxRuntimeRefitter(legacy_onnx, dynamo_map, base_unet)


def test_unmapped_weight_is_refused(dynamo_onnx, dynamo_map, base_unet, lora_a):
    import dataclasses

    weights = lora_deltas(base_unet, [(lora_a, 1.0)])
    name = next(iter(weights))
    partial = dataclasses.replace(dynamo_map, targets={k: v for k, v in dynamo_map.targets.items() if k != name},
                                  unmapped={name: "folded into another constant"})
    with pytest.raises(RefitError, match=f"{name}: folded into another constant"):
        apply_refit_onnxruntime(dynamo_onnx, partial, weights)


def test_tensorrt_weights_are_transposed_and_cast(legacy_onnx, base_unet, lora_a):
    refit_map = build_refit_map(legacy_onnx, base_unet)
    weights = lora_deltas(base_unet, [(lora_a, 1.0)])
    name = "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.weight"  # (16, 32): not square
    for precision, dtype in [(None, np.float32), ("fp16", np.float16), ("fp32", np.float32)]:
        arrays = refit_weights_for_tensorrt(refit_map, weights, precision)
        array = arrays[refit_map.targets[name].initializer]
        assert array.dtype == dtype and array.flags.c_contiguous
        expected = weights[name].numpy().T.astype(dtype)
        assert array.shape == (32, 16) and np.array_equal(array, expected)
    bf16 = refit_weights_for_tensorrt(refit_map, weights, "bf16")[refit_map.targets[name].initializer]
    torch.testing.assert_close(torch.from_numpy(bf16.astype(np.float32)),
                               weights[name].T.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_weights_inside_the_onnx_file_are_refused(dynamo_export, base_unet):
    """The export keeps small weights (biases, norms) inline; onnxruntime could not replace them before folding."""
    refit_map = build_refit_map(dynamo_export, base_unet)
    weights = {"conv_in.bias": base_unet.conv_in.bias.detach() + 1.0}
    with pytest.raises(RefitError, match=r"stored inside the .onnx file \(\['conv_in.bias'\]\).*externalize_weights"):
        apply_refit_onnxruntime(dynamo_export, refit_map, weights)


def test_why_add_initializer_is_not_used(dynamo_onnx, inputs):
    """Canary: onnxruntime applies add_initializer after constant folding, so a weight behind the
    dynamo export's Transpose keeps its old value. If this starts failing, onnxruntime changed."""
    import onnxruntime as ort

    name = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    replacement = ort.OrtValue.ortvalue_from_numpy(np.zeros((16, 16), dtype=np.float32))
    options = ort.SessionOptions()
    options.add_initializer(name, replacement)
    ignored = ort.InferenceSession(str(dynamo_onnx), options, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(_run(ignored, inputs), _run(restore_base(dynamo_onnx), inputs))
