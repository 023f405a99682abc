"""CLIP and T5 text encoders: token ids in, embeddings out (sequence fixed at the tokenizer's length)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..families import Component, Family
from .base import BATCH, ComponentDef, ComponentIO, ExportWrapper, Geometry, TensorDecl, rng
from .model_config import ModelConfig


class _ClipWrapper(ExportWrapper):
    def __init__(self, model: torch.nn.Module, input_names: list[str], penultimate: bool, with_projection: bool,
                 compute_dtype: torch.dtype | None = None):
        super().__init__(model, input_names, compute_dtype)
        self.penultimate, self.with_projection = penultimate, with_projection

    def compute(self, input_ids: torch.Tensor):
        out = self.model(input_ids=input_ids, output_hidden_states=self.penultimate, return_dict=True)
        hidden = out.hidden_states[-2] if self.penultimate else out.last_hidden_state
        pooled = out.text_embeds if self.with_projection else out.pooler_output
        return hidden, pooled


class _T5Wrapper(ExportWrapper):
    def compute(self, input_ids: torch.Tensor):
        return self.model(input_ids=input_ids, return_dict=True).last_hidden_state


def _token_ids(config: ModelConfig, geometry: Geometry, seed: int, eos: int | None) -> np.ndarray:
    """Random ids with an end-of-text token at a random place in each row (CLIP pools at the first eos)."""
    gen = rng(seed, geometry)
    length = config.sequence_length
    vocab = int(config.get("vocab_size", 1000))
    ids = gen.integers(0, vocab, size=(geometry.batch, length), dtype=np.int64)
    if eos is not None and eos < vocab:
        ids[ids == eos] = 0
        where = gen.integers(1, length, size=geometry.batch)
        ids[np.arange(geometry.batch), where] = eos
    return ids


class _TextEncoder(ComponentDef):
    @property
    def resolution_dependent(self) -> bool:
        return False

    def dummy_inputs(self, config, options, geometry, seed=0):
        return {"input_ids": _token_ids(config, geometry, seed, config.get("eos_token_id"))}


class ClipTextEncoder(_TextEncoder):
    """CLIPTextModel / CLIPTextModelWithProjection -> `hidden_states` [B,77,H], `pooled` [B,P].

    sd15 and flux use the last layer's output; sdxl and sd3 use the penultimate layer, as their
    diffusers pipelines do. `pooled` is text_embeds for the projection model, pooler_output otherwise.
    """

    kind = "clip_text_encoder"

    def __init__(self, family: Family, component: Component, penultimate: bool, with_projection: bool):
        super().__init__(family, component)
        self.penultimate, self.with_projection = penultimate, with_projection

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        length, hidden = config.sequence_length, int(config["hidden_size"])
        pooled = int(config["projection_dim"]) if self.with_projection else hidden
        return ComponentIO(
            inputs=(TensorDecl("input_ids", "int64", (BATCH, length)),),
            outputs=(TensorDecl("hidden_states", "float32", (BATCH, length, hidden)),
                     TensorDecl("pooled", "float32", (BATCH, pooled))),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        names = self.io(config, options).input_names
        return _ClipWrapper(module, names, self.penultimate, self.with_projection, compute_dtype).eval()


class T5TextEncoder(_TextEncoder):
    """T5EncoderModel -> `hidden_states` [B,S,D] (S: the T5 tokenizer's model_max_length)."""

    kind = "t5_text_encoder"

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        length, hidden = config.sequence_length, int(config["d_model"])
        return ComponentIO(
            inputs=(TensorDecl("input_ids", "int64", (BATCH, length)),),
            outputs=(TensorDecl("hidden_states", "float32", (BATCH, length, hidden)),),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _T5Wrapper(module, self.io(config, options).input_names, compute_dtype).eval()
