"""Rewrites that keep a quantized denoiser's legacy (TorchScript) ONNX trace dynamic, numerically identical.

Wan's attention applies its rotary embedding by writing into slices of `torch.empty_like(query)`
(`out[..., 0::2] = ...`). The legacy exporter lowers that in-place slice write to a ScatterND whose data is a
zeros constant of the traced size: the graph then runs only at the calibration shape (batch, frames, height,
width): the legacy exporter's Wan graph is static-only (docs/quantize.md). (FP8 hides it by accident: ModelOpt's custom FP8
ops carry no shape, so the exporter keeps the shape ops.) `functional_rotary` computes the same rotation with
`torch.stack(...).flatten(-2)` — the same products and sums in the same order, bit-identical (tested) — so the
INT8 and FP8 graphs keep their declared dynamic axes.

How, without copying diffusers' attention processor: each `WanAttention`'s processor is wrapped so that it is
called with `rotary_emb=None` (it then skips its own rotation) while forward hooks on `norm_q` / `norm_k` (the
processor unflattens their outputs into heads right before the rotation) rotate those outputs instead. No module
is replaced, so the trace keeps every parameter name. Restored on leaving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..families import Family, declared_code, family_info
from .declared_calls import declared_calls


def _rotate(heads: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """diffusers' WanAttnProcessor rotation of [B, S, heads, d] by interleaved pairs, without an in-place write."""
    x1, x2 = heads.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(heads)


class _RotaryOutside:
    """An attention processor called with rotary_emb=None; the rotation is done by the norm hooks."""

    def __init__(self, processor):
        self.processor = processor
        self.rotary: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        self.rotary = rotary_emb
        try:
            return self.processor(attn, hidden_states, encoder_hidden_states, attention_mask, None)
        finally:
            self.rotary = None


@contextlib.contextmanager
def functional_rotary(module: torch.nn.Module) -> Iterator[int]:
    """Inside: every WanAttention of `module` rotates out of place (see the module docstring). Yields how many."""
    from diffusers.models.transformers.transformer_wan import WanAttention

    handles, swapped = [], []
    try:
        for attn in module.modules():
            if not isinstance(attn, WanAttention):
                continue
            wrapper = _RotaryOutside(attn.processor)

            def rotate(norm, args, output, wrapper=wrapper, heads=attn.heads):
                if wrapper.rotary is None:
                    return output
                return _rotate(output.unflatten(2, (heads, -1)), *wrapper.rotary).flatten(2)

            handles += [attn.norm_q.register_forward_hook(rotate), attn.norm_k.register_forward_hook(rotate)]
            swapped.append((attn, attn.processor))
            attn.processor = wrapper
        yield len(swapped)
    finally:
        for handle in handles:
            handle.remove()
        for attn, processor in swapped:
            attn.processor = processor


@contextlib.contextmanager
def strided_rotary(diffusers_module) -> Iterator[None]:
    """Inside: `apply_rotary_emb` as `diffusers_module` calls it pairs the interleaved halves by strided slices
    (`x[..., 0::2]`, `x[..., 1::2]`) instead of `x.reshape(*x.shape[:-1], -1, 2)`: the legacy exporter bakes that
    reshape's batch and token count into the graph (FLUX.2's int8 engine then ran only at the calibration shape).
    The same values in the same order, so bit-identical; other rotary forms go to diffusers' own. Restored on
    leaving."""
    original = diffusers_module.apply_rotary_emb

    def rotate(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
        if not use_real or use_real_unbind_dim != -1 or sequence_dim not in (1, 2):
            return original(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
        cos, sin = freqs_cis
        index = (None, slice(None), None) if sequence_dim == 1 else (None, None, slice(None))
        cos, sin = cos[(*index, slice(None))].to(x.device), sin[(*index, slice(None))].to(x.device)
        x_rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(3)
        return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)

    diffusers_module.apply_rotary_emb = rotate
    try:
        yield
    finally:
        diffusers_module.apply_rotary_emb = original


def real_rotary(module: torch.nn.Module):
    """Qwen-Image's rotary embedding in real cos/sin (components/qwen_image.py: the legacy exporter cannot trace its
    complex tensors either, output bit-identical)."""
    from ..components.qwen_image import real_rotary_embeddings

    return real_rotary_embeddings()


def flux2_strided_rotary(module: torch.nn.Module):
    """FLUX.2's rotation by strided slices (`strided_rotary` over diffusers' transformer_flux2)."""
    from diffusers.models.transformers import transformer_flux2

    return strided_rotary(transformer_flux2)


@contextlib.contextmanager
def trace_patches(module: torch.nn.Module, family: Family) -> Iterator[None]:
    """The family's rewrites for the export trace, as its declaration names them (`FamilyInfo.trace_patches`:
    Wan's out-of-place rotation `functional_rotary`, Qwen-Image's `real_rotary`, FLUX.2's `flux2_strided_rotary`;
    or its `quantize_calls`' own, Z-Image's); none for the other image families."""
    info = family_info(family)
    if (declared := declared_calls(family)) is not None:  # the family declares its own (Z-Image)
        patches = declared.trace_patches()
    elif info.trace_patches is not None:
        patches = declared_code(info.trace_patches)(module)
    else:
        patches = contextlib.nullcontext()
    with patches:
        yield
