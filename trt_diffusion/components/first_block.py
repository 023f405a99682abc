"""First-block caching's two FLUX graphs (diffusers' FirstBlockCacheConfig; ParaAttention's first-block cache):
`first_block`, the embeddings and the first double-stream block, and `rest_blocks`, every later block and the
output layers.

Every step runs `first_block`. Its residual (its image-stream output minus its input) is compared, by the runtime,
with the residual of the last full step: where the mean absolute change relative to that residual's mean absolute
value is at most the threshold, the remaining blocks are skipped and their cached residual (the last block's output
minus the first block's, from the last full step) is added to the first block's output instead. So `first_block`
also takes that cached residual and emits the output a skipped step gives (`cached_noise_pred`: the output layers on
`first_hidden + tail_residual`), and `rest_blocks` emits, beside the noise, the residual a later skipped step adds.
Written over the diffusers modules in FluxTransformer2DModel.forward's order, so a schedule of the two graphs
equals the diffusers hook (tests/components/test_first_block.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import BATCH, ComponentIO, ExportWrapper, TensorDecl, normal, rng
from .model_config import ModelConfig
from .transformers import IMAGE_TOKENS, FluxTransformer

TAIL_RESIDUAL = "tail_residual"
FIRST_HIDDEN, FIRST_ENCODER, FIRST_RESIDUAL = "first_hidden", "first_encoder", "first_residual"
CACHED_NOISE = "cached_noise_pred"


def inner_dim(config: ModelConfig | Mapping) -> int:
    return int(config["num_attention_heads"]) * int(config["attention_head_dim"])


class FirstBlockFlux:
    """FluxTransformer2DModel split after its first block. Not a module: the export wrappers hold the transformer
    as their `model`, so the graphs keep its parameter names."""

    def __init__(self, transformer):
        self.model = transformer

    def _conditioning(self, timestep, guidance, pooled, img_ids, txt_ids, dtype):
        model = self.model
        timestep = timestep.to(dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(dtype) * 1000
        temb = (model.time_text_embed(timestep, pooled) if guidance is None
                else model.time_text_embed(timestep, guidance, pooled))
        rotary = model.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        return temb, rotary

    def _output(self, hidden, temb):
        return self.model.proj_out(self.model.norm_out(hidden, temb))

    def first(self, hidden_states, timestep, encoder_hidden_states, pooled, img_ids, txt_ids, tail_residual,
              guidance=None):
        """(first_hidden, first_encoder, first_residual, cached_noise_pred)."""
        model = self.model
        hidden = model.x_embedder(hidden_states)
        temb, rotary = self._conditioning(timestep, guidance, pooled, img_ids, txt_ids, hidden.dtype)
        encoder = model.context_embedder(encoder_hidden_states)
        block = model.transformer_blocks[0]
        first_encoder, first_hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                            image_rotary_emb=rotary, joint_attention_kwargs=None)
        residual = first_hidden - hidden
        cached = self._output(tail_residual + first_hidden, temb)  # the hook's order: cached residual + output
        return first_hidden, first_encoder, residual, cached

    def rest(self, first_hidden, first_encoder, timestep, pooled, img_ids, txt_ids, guidance=None):
        """(noise_pred, tail_residual): the remaining blocks from the first block's outputs."""
        model = self.model
        temb, rotary = self._conditioning(timestep, guidance, pooled, img_ids, txt_ids, first_hidden.dtype)
        hidden, encoder = first_hidden, first_encoder
        for block in (*model.transformer_blocks[1:], *model.single_transformer_blocks):
            encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                    image_rotary_emb=rotary, joint_attention_kwargs=None)
        return self._output(hidden, temb), hidden - first_hidden


class _FirstWrapper(ExportWrapper):
    def __init__(self, model, input_names, compute_dtype=None):
        super().__init__(model, input_names, compute_dtype)
        self.graphs = FirstBlockFlux(model)

    def compute(self, **inputs: torch.Tensor):
        guidance = inputs.get("guidance")
        return self.graphs.first(self.cast(inputs["hidden_states"]), self.cast(inputs["timestep"]),
                                 self.cast(inputs["encoder_hidden_states"]), self.cast(inputs["pooled_projections"]),
                                 self.cast(inputs["img_ids"]), self.cast(inputs["txt_ids"]),
                                 self.cast(inputs[TAIL_RESIDUAL]), None if guidance is None else self.cast(guidance))


class _RestWrapper(_FirstWrapper):
    def compute(self, **inputs: torch.Tensor):
        guidance = inputs.get("guidance")
        return self.graphs.rest(self.cast(inputs[FIRST_HIDDEN]), self.cast(inputs[FIRST_ENCODER]),
                                self.cast(inputs["timestep"]), self.cast(inputs["pooled_projections"]),
                                self.cast(inputs["img_ids"]), self.cast(inputs["txt_ids"]),
                                None if guidance is None else self.cast(guidance))


class FirstBlockPiece(FluxTransformer):
    """`first_block` or `rest_blocks` of a FLUX transformer (step_cache.PIECES)."""

    def __init__(self, family, component, piece: str):
        super().__init__(family, component)
        self.piece = piece

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        whole = super().io(config, options)
        by_name = {d.name: d for d in whole.inputs}
        width = inner_dim(config)
        text = by_name["encoder_hidden_states"].dims[1]
        image = TensorDecl(FIRST_HIDDEN, "float32", (BATCH, IMAGE_TOKENS, width))
        encoder = TensorDecl(FIRST_ENCODER, "float32", (BATCH, text, width))
        residual = TensorDecl(TAIL_RESIDUAL, "float32", (BATCH, IMAGE_TOKENS, width))
        noise = whole.outputs[0]
        if self.piece == "first_block":
            return ComponentIO(inputs=whole.inputs + (residual,), outputs=(
                image, encoder, TensorDecl(FIRST_RESIDUAL, "float32", (BATCH, IMAGE_TOKENS, width)),
                TensorDecl(CACHED_NOISE, "float32", noise.dims)))
        conditioning = tuple(d for d in whole.inputs if d.name not in ("hidden_states", "encoder_hidden_states"))
        return ComponentIO(inputs=(image, encoder) + conditioning, outputs=(noise, residual))

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        names = self.io(config, options).input_names
        kind = _FirstWrapper if self.piece == "first_block" else _RestWrapper
        return kind(module, names, compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        # the whole transformer's inputs (the same seeded values), then the pieces' own
        values = FluxTransformer(self.family, self.component).dummy_inputs(config, options, geometry, seed)
        shapes = self.shapes(config, options, geometry)
        gen = rng(seed + 1, geometry)
        for name in (TAIL_RESIDUAL, FIRST_HIDDEN, FIRST_ENCODER):
            if name in shapes:
                values[name] = normal(gen, shapes[name])
        return {name: values[name] for name in shapes}

