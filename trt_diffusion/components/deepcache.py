"""DeepCache's two UNet graphs (Ma et al., CVPR 2024): `unet_deep`, the whole UNet also emitting the deep feature,
and `unet_shallow`, the path a cached step runs on that feature.

The UNet is cut at a *branch*: a skip level `(block, layer)` with `branch = block × (layers_per_block + 1) + layer`
(the ids of the DeepCache package: with SD1.5's two layers per block, block × 3 + layer). On a cached step
DeepCache runs conv_in, the down blocks before `block`, the first `layer` layers of down block `block`, then
up block `block` (counted from the output) from its resnet `layers_per_block - layer` on, with everything deeper
taken from the last full step. Everything that cached step reads deeper than the cut is one tensor, the hidden
state entering that resnet: the *deep feature*. So the shallow graph takes it as an input and the deep graph
emits it beside the noise prediction; the skip connections the shallow path consumes are all computed fresh.

Both graphs are written here layer by layer over the diffusers modules (whole blocks where a block runs whole), in
the order UNet2DConditionModel.forward runs them, so `unet_deep`'s noise equals the UNet's bit for bit and a
schedule of deep and shallow calls equals the DeepCache package's hooks (tests/components/test_deepcache.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .base import BATCH, ComponentIO, ExportWrapper, TensorDecl
from .model_config import ModelConfig
from .unet import MID_RESIDUAL, UNet, added_cond_kwargs, down_residual_name, residual_layout, spatial_dims

FEATURE = "deep_feature"


@dataclass(frozen=True)
class Cut:
    """Where a branch cuts the UNet: down block `block` runs its first `layer` layers; the up block of the same
    level (counted from the output) runs its resnets from `first_up_resnet` on."""

    block: int
    layer: int
    layers_per_block: int

    @classmethod
    def of(cls, branch: int, layers_per_block: int) -> Cut:
        return cls(branch // (layers_per_block + 1), branch % (layers_per_block + 1), layers_per_block)

    @property
    def first_up_resnet(self) -> int:
        return self.layers_per_block - self.layer

    @property
    def fresh_residuals(self) -> int:
        """How many skip connections the shallow path computes (conv_in's, then each down layer before the cut):
        a prefix of the UNet's list, and all that the layers it runs consume."""
        return 1 + self.block * (self.layers_per_block + 1) + self.layer


def layers_per_block(config: ModelConfig | Mapping) -> int:
    layers = config["layers_per_block"]
    if not isinstance(layers, int):
        raise ValueError("DeepCache's branch ids need one layers_per_block for every block")
    return layers


def feature_decl(config: ModelConfig | Mapping, cut: Cut) -> TensorDecl:
    """The deep feature: the hidden state entering up block `cut.block`'s first shallow resnet, at that block's
    resolution, with the channels of the layer before it (the up block's own, or the deeper block's output)."""
    channels = list(config["block_out_channels"])
    deepest = len(channels) - 1
    level = cut.block
    if cut.first_up_resnet > 0:  # after an earlier resnet of the same up block: that block's width
        width = channels[level]
    else:  # what the deeper up block (or the mid block) hands over, upsampled to this level
        width = channels[min(level + 1, deepest)]
    # the up block at level L works at the resolution of down level L (its input comes upsampled from L+1)
    return TensorDecl(FEATURE, "float32", (BATCH, width, *spatial_dims(level)))


class DeepCacheUNet:
    """A UNet2DConditionModel run as DeepCache's deep (whole UNet + feature) or shallow (feature in) graph. Not a
    module: the export wrapper holds the UNet as its `model`, so the graphs' initializers keep the UNet's own
    parameter names (refit maps and LoRA refit cover both graphs as they cover the UNet's)."""

    def __init__(self, unet, branch: int):
        self.unet = unet
        self.cut = Cut.of(branch, layers_per_block(unet.config))
        if self.cut.block >= len(unet.down_blocks):
            raise ValueError(f"branch {branch} is past this UNet's {len(unet.down_blocks)} blocks")

    # -- the pieces of UNet2DConditionModel.forward both graphs share -------------------------------------------
    def _embed(self, sample, timestep, encoder_hidden_states, added):
        unet = self.unet
        emb = unet.time_embedding(unet.get_time_embed(sample=sample, timestep=timestep), None)
        aug = unet.get_aug_embed(emb=emb, encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added)
        emb = emb + aug if aug is not None else emb
        if unet.time_embed_act is not None:
            emb = unet.time_embed_act(emb)
        encoder_hidden_states = unet.process_encoder_hidden_states(
            encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added)
        return emb, encoder_hidden_states

    @staticmethod
    def _attend(attention, hidden, encoder_hidden_states):
        return attention(hidden, encoder_hidden_states=encoder_hidden_states, cross_attention_kwargs=None,
                         attention_mask=None, encoder_attention_mask=None, return_dict=False)[0]

    def _upsample_size(self, sample) -> bool:
        factor = 2 ** self.unet.num_upsamplers
        return any(dim % factor != 0 for dim in sample.shape[-2:])

    def _down_layers(self, block, hidden, emb, ehs, count: int):
        """The first `count` resnet(+attention) layers of a down block, with their outputs (its skip connections)."""
        outputs = []
        attentions = getattr(block, "attentions", None)
        for index in range(count):
            hidden = block.resnets[index](hidden, emb)
            if attentions is not None:
                hidden = self._attend(attentions[index], hidden, ehs)
            outputs.append(hidden)
        return hidden, outputs

    def _up_layers(self, block, hidden, residuals: Sequence[torch.Tensor], emb, ehs, start: int, upsample_size):
        """Up block resnets `start`.. (resnet i concatenating the block's skip connection `last - i`, as diffusers
        pops them from the end; `residuals` may hold only the fresh ones, a prefix), then its upsampler."""
        attentions = getattr(block, "attentions", None)
        last = len(block.resnets) - 1
        for index in range(start, len(block.resnets)):
            hidden = torch.cat([hidden, residuals[last - index]], dim=1)
            hidden = block.resnets[index](hidden, emb)
            if attentions is not None:
                hidden = self._attend(attentions[index], hidden, ehs)
        for upsampler in block.upsamplers or ():
            hidden = upsampler(hidden, upsample_size)
        return hidden

    def _run_up_block(self, block, hidden, residuals, emb, ehs, upsample_size):
        if getattr(block, "has_cross_attention", False):
            return block(hidden_states=hidden, temb=emb, res_hidden_states_tuple=residuals, encoder_hidden_states=ehs,
                         cross_attention_kwargs=None, upsample_size=upsample_size, attention_mask=None,
                         encoder_attention_mask=None)
        return block(hidden_states=hidden, temb=emb, res_hidden_states_tuple=residuals, upsample_size=upsample_size)

    def _finish(self, hidden):
        unet = self.unet
        if unet.conv_norm_out:
            hidden = unet.conv_act(unet.conv_norm_out(hidden))
        return unet.conv_out(hidden)

    def _up_from_cut(self, hidden, residuals: list, emb, ehs, sample, forward_size: bool):
        """Up block `cut.block` from the cut on, then every shallower up block, then the output layers; `residuals`
        holds at least the fresh prefix of the skip connections (conv_in's first)."""
        unet, cut = self.unet, self.cut
        count = len(unet.up_blocks)
        per_block = cut.layers_per_block + 1
        for position in range(count - 1 - cut.block, count):
            level = count - 1 - position  # up block `position` is level `level` counted from the output
            block_residuals = tuple(residuals[level * per_block:(level + 1) * per_block])
            size = None
            if position != count - 1 and forward_size:
                size = residuals[level * per_block - 1].shape[2:]
            if level == cut.block:
                hidden = self._up_layers(unet.up_blocks[position], hidden, block_residuals, emb, ehs,
                                         cut.first_up_resnet, size)
            else:
                hidden = self._run_up_block(unet.up_blocks[position], hidden, block_residuals, emb, ehs, size)
        return self._finish(hidden)

    @staticmethod
    def _down_block(block, hidden, emb, ehs):
        """(hidden, its skip outputs): one whole down block, as UNet2DConditionModel.forward calls it."""
        if getattr(block, "has_cross_attention", False):
            return block(hidden_states=hidden, temb=emb, encoder_hidden_states=ehs, attention_mask=None,
                         cross_attention_kwargs=None, encoder_attention_mask=None)
        return block(hidden_states=hidden, temb=emb)

    def forward_deep(self, sample, timestep, encoder_hidden_states, added=None, down_residuals=None,
                     mid_residual=None):
        """(noise_pred, deep_feature): the whole UNet, as UNet2DConditionModel.forward runs it."""
        unet, cut = self.unet, self.cut
        forward_size = self._upsample_size(sample)
        emb, ehs = self._embed(sample, timestep, encoder_hidden_states, added)
        hidden = unet.conv_in(sample)
        residuals = [hidden]
        for block in unet.down_blocks:
            hidden, outputs = self._down_block(block, hidden, emb, ehs)
            residuals += outputs
        if down_residuals is not None:
            residuals = [r + extra for r, extra in zip(residuals, down_residuals)]
        if getattr(unet.mid_block, "has_cross_attention", False):
            hidden = unet.mid_block(hidden, emb, encoder_hidden_states=ehs, attention_mask=None,
                                    cross_attention_kwargs=None, encoder_attention_mask=None)
        else:
            hidden = unet.mid_block(hidden, emb)
        if mid_residual is not None:
            hidden = hidden + mid_residual
        count = len(unet.up_blocks)
        per_block = cut.layers_per_block + 1
        for position in range(count - 1 - cut.block):  # the up blocks deeper than the cut, whole
            level = count - 1 - position
            size = residuals[level * per_block - 1].shape[2:] if forward_size else None
            hidden = self._run_up_block(unet.up_blocks[position], hidden,
                                        tuple(residuals[level * per_block:(level + 1) * per_block]), emb, ehs, size)
        # up block `cut.block`'s resnets before the cut: what a cached step takes from here
        block = unet.up_blocks[count - 1 - cut.block]
        block_residuals = residuals[cut.block * per_block:(cut.block + 1) * per_block]
        attentions = getattr(block, "attentions", None)
        for index in range(cut.first_up_resnet):
            hidden = torch.cat([hidden, block_residuals[-1 - index]], dim=1)
            hidden = block.resnets[index](hidden, emb)
            if attentions is not None:
                hidden = self._attend(attentions[index], hidden, ehs)
        feature = hidden
        return self._up_from_cut(feature, residuals, emb, ehs, sample, forward_size), feature

    def forward_shallow(self, sample, timestep, encoder_hidden_states, feature, added=None, down_residuals=None):
        """noise_pred of a cached step from the deep feature of the last full step; `down_residuals` are the
        ControlNet's residuals of the fresh skip connections (the first `cut.fresh_residuals`)."""
        unet, cut = self.unet, self.cut
        forward_size = self._upsample_size(sample)
        emb, ehs = self._embed(sample, timestep, encoder_hidden_states, added)
        hidden = unet.conv_in(sample)
        residuals = [hidden]
        for block in unet.down_blocks[:cut.block]:
            hidden, outputs = self._down_block(block, hidden, emb, ehs)
            residuals += outputs
        _, outputs = self._down_layers(unet.down_blocks[cut.block], hidden, emb, ehs, cut.layer)
        residuals += outputs
        if down_residuals is not None:
            residuals = [r + extra for r, extra in zip(residuals, down_residuals)]
        return self._up_from_cut(feature, residuals, emb, ehs, sample, forward_size)


class _DeepWrapper(ExportWrapper):
    def __init__(self, unet, input_names: list[str], branch: int, residual_count: int, compute_dtype=None):
        super().__init__(unet, input_names, compute_dtype)
        self.graphs = DeepCacheUNet(unet, branch)
        self.residual_count = residual_count

    def _residuals(self, inputs):
        if not self.residual_count:
            return None
        return [self.cast(inputs[down_residual_name(i)]) for i in range(self.residual_count)]

    def compute(self, **inputs: torch.Tensor):
        mid = inputs.get(MID_RESIDUAL)
        return self.graphs.forward_deep(self.cast(inputs["sample"]), self.cast(inputs["timestep"]),
                                        self.cast(inputs["encoder_hidden_states"]), added_cond_kwargs(inputs),
                                        self._residuals(inputs), None if mid is None else self.cast(mid))


class _ShallowWrapper(_DeepWrapper):
    def compute(self, **inputs: torch.Tensor):
        return self.graphs.forward_shallow(self.cast(inputs["sample"]), self.cast(inputs["timestep"]),
                                           self.cast(inputs["encoder_hidden_states"]), self.cast(inputs[FEATURE]),
                                           added_cond_kwargs(inputs), self._residuals(inputs))


class DeepCachePiece(UNet):
    """`unet_deep` (outputs `noise_pred`, `deep_feature`) or `unet_shallow` (adds the `deep_feature` input): the
    UNet's inputs otherwise, ControlNet residuals included (the shallow graph takes the fresh ones only)."""

    def __init__(self, family, component, piece: str):
        super().__init__(family, component)
        self.piece = piece

    def cut(self, config: ModelConfig, options: Mapping[str, Any]) -> Cut:
        return Cut.of(int(str(options["step_cache"]).rsplit("branch=", 1)[1]), layers_per_block(config))

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        whole = super().io(config, options)
        cut = self.cut(config, options)
        feature = feature_decl(config, cut)
        if self.piece == "unet_deep":
            return ComponentIO(inputs=whole.inputs, outputs=whole.outputs + (feature,))
        fresh = {down_residual_name(i) for i in range(cut.fresh_residuals)}
        inputs = tuple(d for d in whole.inputs if not d.name.startswith(("down_block_residual", "mid_block_residual"))
                       or d.name in fresh)
        return ComponentIO(inputs=inputs + (feature,), outputs=whole.outputs)

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        io = self.io(config, options)
        cut = self.cut(config, options)
        branch = cut.block * (cut.layers_per_block + 1) + cut.layer
        if self.piece == "unet_deep":
            residuals = len(residual_layout(config)) if options.get("controlnet_residuals") else 0
            return _DeepWrapper(module, io.input_names, branch, residuals, compute_dtype).eval()
        residuals = cut.fresh_residuals if options.get("controlnet_residuals") else 0
        return _ShallowWrapper(module, io.input_names, branch, residuals, compute_dtype).eval()
