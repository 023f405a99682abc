"""fp8/int8 of a language-model text encoder (Qwen-Image's Qwen2.5-VL, FLUX.2's Mistral-3, Klein's Qwen3).

Calibrated on the tokens the runtime feeds the engine (the family's template and tokenization, the calibration
prompts and, for the true-CFG families, the empty negative prompt), gated on the hidden states the engine returns:
held-out prompts through the fp32 module and through the Q/DQ graph on ONNX Runtime, PSNR per prompt.

Only the encoder is loaded, never the pipeline: the peak is the encoder, its Q/DQ trace, or the gate's session. The
held-out prompts' fp32 states are taken before calibration (ModelOpt quantizes in place), so the module is never
loaded twice. Layers the engine never runs (Qwen2.5-VL's vision tower, an LM head) are left out of the selection:
ModelOpt would find no statistics for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..components import get_component, load_model_config
from ..engines_file import ResolvedModel
from ..errors import QuantizeError
from ..families import CfgKind, Component, Family, declared_code, family_info
from .exclusions import QUANTIZABLE_TYPES, LayerSelection, select_layers
from .feeds import DenoiserInterface, as_numpy
from .gate import GateResult, GateThresholds, judge_outputs, onnxruntime_session

Feeds = dict[str, torch.Tensor]
UNUSED = "not run by the engine"  # the exclusion reason of a layer outside the engine's graph


def encoder_interface(model: ResolvedModel) -> DenoiserInterface:
    """The encoder engine's declared I/O (its text axis from engines.yaml's text_length, as the export has it)."""
    definition = get_component(model.family, Component.text_encoder)
    config = load_model_config(model.source.path, model.family, Component.text_encoder)
    options = {"text_length": ",".join(map(str, model.text_lengths))} if model.text_lengths else {}
    return DenoiserInterface(model.family, Component.text_encoder, definition, config, options,
                             definition.io(config, options))


def with_negative(family: Family, prompts: Sequence[str]) -> list[str]:
    """The prompts the encoder sees for these: with true CFG (Qwen-Image, Klein) also the empty negative prompt,
    as the runtime and the parity stage send it."""
    prompts = list(prompts)
    # embedded guidance (FLUX.2 dev) runs no negative prompt
    return prompts if family_info(family).cfg_kind is CfgKind.embedded else prompts + [""]


def prompt_feeds(model: ResolvedModel, prompts: Sequence[str]) -> list[Feeds]:
    """The engine's inputs for each prompt, tokenized as the runtime tokenizes them (its template, its padding)."""
    from transformers import AutoTokenizer

    info = family_info(model.family)
    tokens = declared_code(info.encoder_tokens)
    lengths = model.text_lengths or info.text_lengths
    text_max = lengths[2] if lengths else None
    tokenizer = AutoTokenizer.from_pretrained(model.source.path / "tokenizer")
    feeds = []
    for prompt in prompts:
        ids, mask = tokens(model.family, tokenizer, prompt, text_max)
        feeds.append({"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)})
    return feeds


def run_layers(wrapper: torch.nn.Module, module: torch.nn.Module, feeds: Feeds) -> set[str]:
    """The quantizable layers of `module` one engine call runs."""
    ran: set[str] = set()
    handles = [layer.register_forward_pre_hook(lambda _m, _a, name=name: ran.add(name))
               for name, layer in module.named_modules() if name and isinstance(layer, QUANTIZABLE_TYPES)]
    try:
        with torch.inference_mode():
            wrapper(*feeds.values())
    finally:
        for handle in handles:
            handle.remove()
    return ran


def encoder_selection(module: torch.nn.Module, ran: set[str], patterns: Sequence[str]) -> LayerSelection:
    """select_layers over the layers the engine runs; the others excluded by their outermost unused module (one
    ModelOpt entry for a whole vision tower, not one per layer)."""
    chosen = select_layers(module, patterns)
    excluded = {name: why for name, why in chosen.excluded.items() if name in ran}
    used_prefixes = {".".join(name.split(".")[:i]) for name in ran for i in range(1, name.count(".") + 2)}
    for name in chosen.quantized + tuple(chosen.excluded):
        if name in ran:
            continue
        parts = name.split(".")
        outermost = next(".".join(parts[:i]) for i in range(1, len(parts) + 1)
                         if ".".join(parts[:i]) not in used_prefixes)
        excluded[outermost] = UNUSED
    quantized = tuple(name for name in chosen.quantized if name in ran)
    return LayerSelection(quantized, excluded, chosen.patterns)


def forward_loop(wrapper: torch.nn.Module, feeds: list[Feeds]) -> Callable[[torch.nn.Module], None]:
    """ModelOpt's forward loop: every calibration prompt through the engine's computation."""
    def run(_module: torch.nn.Module) -> None:
        with torch.inference_mode():
            for call in feeds:
                wrapper(*call.values())
    return run


def reference_states(wrapper: torch.nn.Module, feeds: list[Feeds]) -> list[np.ndarray]:
    """The fp32 module's hidden states for each call (before ModelOpt changes the module)."""
    with torch.inference_mode():
        return [wrapper(*call.values()).float().numpy().copy() for call in feeds]


def gate_states(onnx_path: Path, interface: DenoiserInterface, feeds: list[Feeds], expected: list[np.ndarray],
                precision: str, thresholds: GateThresholds) -> GateResult:
    """The Q/DQ graph's hidden states against the fp32 module's, per held-out prompt: PSNR over the reference's
    range (worst and mean), max |difference|, NaN/Inf. No images: the engine's output is the states."""
    session = onnxruntime_session(onnx_path)
    outputs = []
    for call, reference in zip(feeds, expected):
        actual = session.run([interface.output_name], as_numpy(call))[0]
        if actual.shape != reference.shape:
            raise QuantizeError(f"the Q/DQ {interface.component.value} returned {list(actual.shape)}, the module "
                                f"{list(reference.shape)}")
        outputs.append((reference, actual))
    return judge_outputs(precision, thresholds, outputs)
