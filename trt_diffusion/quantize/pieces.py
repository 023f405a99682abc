"""A step cache's pieces of a quantized denoiser (docs/step-cache.md): DeepCache's `unet_deep` / `unet_shallow`,
first-block caching's `first_block` / `rest_blocks`.

The pieces are graphs over the denoiser's own modules (components/deepcache.py, components/first_block.py), so the
calibrated module is the whole of what they need: each piece is traced through its declaration's wrapper from the
SAME quantized module, restored from the denoiser's one calibration (its key does not see the cache), and carries the
same quantizer states as the quantized denoiser's graph.

A piece takes inputs no pipeline call carries (the deep feature, the first block's outputs, the tail residual): they
are computed here from a recorded call by running the other piece on the module, as the runtime's schedule feeds
them. The gate compares each piece's Q/DQ graph with the fp32 piece on the held-out calls, every output (the deep
feature and the residuals as well as the noise), both fed the same fp32 companions: a tensor diff per piece; the
cached pipeline's images are judged by `parity`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import QuantizeError
from ..families import Component
from ..memory import release_memory, return_large_blocks_to_os
from .calibration import CalibrationRecipe, CallRecorder, denoiser_of, run_pipeline
from .feeds import DenoiserInterface, as_numpy
from .gate import (
    GateResult,
    GateThresholds,
    gate_failures,
    held_out_recipe,
    judge_outputs,
    onnxruntime_session,
    release_weights,
    worst_value,
)

Feeds = dict[str, torch.Tensor]


def _run(interface: DenoiserInterface, module: torch.nn.Module, available: Feeds) -> dict[str, torch.Tensor]:
    """One piece's (or the whole denoiser's) outputs by name, in torch, from the inputs it declares."""
    wrapper = interface.wrapper(module)
    with torch.inference_mode():
        outputs = wrapper(*(available[name] for name in interface.input_names))
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
    return dict(zip(interface.io.output_names, outputs))


def companion_inputs(piece: str, module: torch.nn.Module, base: Feeds,
                     sibling: Callable[[str], DenoiserInterface]) -> Feeds:
    """The inputs of `piece` that a denoiser call does not carry, computed on `module` from the call's feeds `base`
    (the whole denoiser's): what the runtime hands the piece on a cached schedule. `sibling(name)` is the interface
    of another piece of the same cache."""
    if piece == "unet_shallow":  # the feature the last full step kept: that of this very call
        from ..components.deepcache import FEATURE

        return {FEATURE: _run(sibling("unet_deep"), module, base)[FEATURE]}
    if piece in ("first_block", "rest_blocks"):
        from ..components.first_block import FIRST_ENCODER, FIRST_HIDDEN, TAIL_RESIDUAL

        first = sibling("first_block")
        zeros = {TAIL_RESIDUAL: torch.zeros(_declared_shape(first, TAIL_RESIDUAL, base), dtype=torch.float32)}
        head = _run(first, module, {**base, **zeros})
        carried = {FIRST_HIDDEN: head[FIRST_HIDDEN], FIRST_ENCODER: head[FIRST_ENCODER]}
        if piece == "rest_blocks":
            return carried
        # the tail a skipped step adds: what the remaining blocks added on this call (as at the last full step)
        return {TAIL_RESIDUAL: _run(sibling("rest_blocks"), module, {**base, **carried})[TAIL_RESIDUAL]}
    if piece == "unet_deep":
        return {}
    raise QuantizeError(f"no quantized graph of the step-cache piece {piece!r}")


def _declared_shape(interface: DenoiserInterface, name: str, base: Feeds) -> tuple[int, ...]:
    """A FLUX token tensor's shape: [batch, image tokens, inner width], read off the call's hidden states."""
    hidden = base["hidden_states"]
    decl = next(d for d in interface.io.inputs if d.name == name)
    return (int(hidden.shape[0]), int(hidden.shape[1]), int(decl.dims[-1]))


def piece_feeds(interface: DenoiserInterface, module: torch.nn.Module, base: Feeds,
                sibling: Callable[[str], DenoiserInterface]) -> Feeds:
    """The piece's declared inputs, in order: the call's, then the companions computed on `module`."""
    extra = companion_inputs(interface.piece, module, base, sibling)
    missing = [name for name in interface.input_names if name not in base and name not in extra]
    if missing:
        raise QuantizeError(f"the {interface.graph_name} graph takes {missing}, which neither the call nor the "
                            "cache's other piece provides")
    values = {**base, **extra}
    return {name: values[name] for name in interface.input_names}


def run_piece_gate(pipe, base: DenoiserInterface, interface: DenoiserInterface, onnx_path, precision: str,
                   recipe: CalibrationRecipe, thresholds: GateThresholds, held_out_samples: int,
                   sibling: Callable[[str], DenoiserInterface], component: Component | None = None) -> GateResult:
    """The piece's Q/DQ graph against the fp32 piece on every held-out denoiser call: every output's PSNR over the
    fp32 output's range against the denoiser's output bar, NaN/Inf. The fp32 pipeline's denoiser is spent after
    (its weights released before the session opens, as in `gate.run_gate`)."""
    prompts, seeds = held_out_recipe(recipe, held_out_samples)
    recorder = CallRecorder()
    run_pipeline(pipe, base.family, prompts, seeds, recipe.steps, recipe.width, recipe.height, output_type="latent",
                 recorder=recorder, max_sequence_length=recipe.max_sequence_length, progress_stage="gate: PyTorch",
                 frames=recipe.frames, component=component)
    if not recorder.calls:
        raise QuantizeError(f"the held-out generations never called the {base.component.value}: nothing to gate")
    module = denoiser_of(pipe, component)
    cases = []  # (feeds of the piece, its fp32 outputs)
    for call in recorder.calls:
        feeds = piece_feeds(interface, module, base.feeds(call), sibling)
        cases.append((as_numpy(feeds), {k: v.numpy() for k, v in _run(interface, module, feeds).items()}))
    release_weights(module)
    release_memory()
    return_large_blocks_to_os()
    session = onnxruntime_session(onnx_path)
    pairs, per_output = [], {name: [] for name in interface.io.output_names}
    for feeds, expected in cases:
        got = dict(zip(interface.io.output_names, session.run(interface.io.output_names, feeds)))
        for name, value in expected.items():
            pairs.append((value, got[name]))
            per_output[name].append(judge_outputs(precision, thresholds, [(value, got[name])]).output_psnr_db_min)
    result = judge_outputs(precision, thresholds, pairs)
    result.calls = len(cases)  # held-out calls (each judged on every output)
    result.outputs = {name: round(worst_value(values), 3) for name, values in per_output.items()}
    result.failures = [f"{interface.graph_name} ({_worst_named(result.outputs)}): {why}"
                       for why in gate_failures(result, thresholds)]
    return result


def _worst_named(outputs: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.2f} dB" for name, value in outputs.items())
