"""lora_deltas: every naming gives the same weights, and they equal diffusers/PEFT's own fusing."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
from safetensors.torch import load_file

from trt_diffusion.errors import ModelError, RefitError
from trt_diffusion.lora import LoraNaming, lora_deltas, read_lora_file

FUSE_TOLERANCE = 1e-5


def _max_diff(ours: dict, reference: torch.nn.Module) -> float:
    params = dict(reference.named_parameters())
    return max((ours[name] - params[name]).abs().max().item() for name in ours)


def _changed(base: torch.nn.Module, other: torch.nn.Module) -> set[str]:
    theirs = dict(other.named_parameters())
    return {name for name, p in base.named_parameters() if not torch.equal(p, theirs[name])}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize("scale", [1.0, 0.7])
def test_single_lora_matches_diffusers_fuse(base_unet, lora_a, helpers, scale):
    ours = lora_deltas(base_unet, [(lora_a, scale)])
    reference = helpers.fused_with_diffusers(base_unet, [(lora_a, scale)])
    assert set(ours) == _changed(base_unet, reference)
    assert len(ours) == 32  # q, k, v, out of 8 attention blocks
    assert _max_diff(ours, reference) <= FUSE_TOLERANCE


def test_conv_lora_with_alpha_from_metadata_matches_diffusers(base_unet, lora_b, helpers):
    ours = lora_deltas(base_unet, [(lora_b, 1.0)])
    assert any(base_unet.get_parameter(name).ndim == 4 and base_unet.get_parameter(name).shape[-1] == 3
               for name in ours), "LoRA B should change a 3x3 convolution"
    assert any(name.endswith("proj_in.weight") for name in ours), "LoRA B should change a 1x1 convolution"
    reference = helpers.fused_with_diffusers(base_unet, [(lora_b, 1.0)])
    assert set(ours) == _changed(base_unet, reference)
    assert _max_diff(ours, reference) <= FUSE_TOLERANCE
    # alpha 3 / rank 2: the metadata is read, not assumed to be alpha == rank
    unscaled = lora_deltas(base_unet, [(lora_b, 1.0 / 1.5)])
    name = next(n for n in ours if n.endswith("to_v.weight"))
    base = base_unet.get_parameter(name)
    torch.testing.assert_close(ours[name] - base, (unscaled[name] - base) * 1.5, rtol=1e-5, atol=1e-7)


def test_two_loras_with_scales_match_diffusers(base_unet, lora_a, lora_b, helpers):
    loras = [(lora_a, 0.8), (lora_b, -0.5)]
    ours = lora_deltas(base_unet, loras)
    reference = helpers.fused_with_diffusers(base_unet, loras)
    assert set(ours) == _changed(base_unet, reference)
    assert _max_diff(ours, reference) <= FUSE_TOLERANCE


def test_scale_zero_changes_nothing(base_unet, lora_a, lora_b):
    assert lora_deltas(base_unet, [(lora_a, 0.0)]) == {}
    # with another LoRA: the zero-scaled one adds exactly nothing
    _assert_same(lora_deltas(base_unet, [(lora_a, 0.0), (lora_b, 1.0)]), lora_deltas(base_unet, [(lora_b, 1.0)]))


def test_base_model_is_never_modified(base_unet, lora_a):
    before = {n: p.clone() for n, p in base_unet.named_parameters()}
    lora_deltas(base_unet, [(lora_a, 1.0)])
    assert all(torch.equal(before[n], p) for n, p in base_unet.named_parameters())


def test_kohya_naming_gives_the_same_deltas(base_unet, lora_a, rewrite_lora, helpers):
    kohya = rewrite_lora(lora_a, helpers.to_kohya, "kohya")
    assert read_lora_file(kohya).naming is LoraNaming.kohya
    assert next(iter(load_file(str(kohya)))).startswith("lora_unet_down_blocks_1_attentions_0_transformer_blocks_0")
    _assert_same(lora_deltas(base_unet, [(kohya, 0.6)]), lora_deltas(base_unet, [(lora_a, 0.6)]))


def test_kohya_alpha_scales_the_delta(base_unet, lora_a, rewrite_lora, helpers):
    """alpha = rank / 2 with the up weights doubled is the same LoRA: only a correct alpha/rank gives equality."""

    def halve_alpha(state: dict) -> dict:
        kohya = helpers.to_kohya(state)
        return {k: (v * 2 if k.endswith("lora_up.weight") else v / 2 if k.endswith(".alpha") else v)
                for k, v in kohya.items()}

    kohya = rewrite_lora(lora_a, halve_alpha, "kohya-half-alpha")
    ours = lora_deltas(base_unet, [(kohya, 1.0)])
    _assert_same(ours, lora_deltas(base_unet, [(lora_a, 1.0)]))
    # and diffusers' own kohya loading agrees
    assert _max_diff(ours, helpers.fused_with_diffusers(base_unet, [(kohya, 1.0)])) <= FUSE_TOLERANCE


@pytest.mark.parametrize("form", ["lora.down/up", "processor", "adapter-named"])
def test_older_diffusers_forms_give_the_same_deltas(base_unet, lora_a, rewrite_lora, helpers, form):
    from diffusers.utils.state_dict_utils import StateDictType, convert_state_dict_to_diffusers

    transforms = {
        "lora.down/up": lambda s: convert_state_dict_to_diffusers(s, original_type=StateDictType.PEFT),
        "processor": helpers.to_processor_naming,
        "adapter-named": lambda s: {k.replace(".weight", ".default_0.weight"): v for k, v in s.items()},
    }
    rewritten = rewrite_lora(lora_a, transforms[form], f"form-{form.replace('/', '-')}")
    _assert_same(lora_deltas(base_unet, [(rewritten, 1.0)]), lora_deltas(base_unet, [(lora_a, 1.0)]))


def test_peft_wrapped_model_base_layer_names(base_unet, lora_a):
    """A model with an adapter injected names its weights `to_q.base_layer.weight` (TensorRT #4090)."""
    from peft import LoraConfig

    wrapped = copy.deepcopy(base_unet)
    wrapped.add_adapter(LoraConfig(r=2, target_modules=["to_q", "to_k"]), adapter_name="other")
    assert any(".base_layer." in n for n, _ in wrapped.named_parameters())
    _assert_same(lora_deltas(wrapped, [(lora_a, 1.0)]), lora_deltas(base_unet, [(lora_a, 1.0)]))


def test_lora_for_another_architecture_lists_unmatched_keys(base_unet):
    from trt_diffusion.models.tiny import build_tiny_lora, build_tiny_pipeline

    sdxl_lora = build_tiny_lora(build_tiny_pipeline("sdxl"), seed=3)
    with pytest.raises(RefitError, match=r"does not fit this unet: \d+ of \d+ LoRA key\(s\) match no weight") as err:
        lora_deltas(base_unet, [(_as_file(sdxl_lora), 1.0)])
    message = str(err.value)
    assert re.search(r"\.\.\. and \d+ more key\(s\)$", message)
    assert message.count("\n  ") == 11  # ten keys listed, then the count of the rest


def test_renamed_keys_are_listed(base_unet, lora_a, rewrite_lora):
    renamed = rewrite_lora(lora_a, lambda s: {k.replace("attn1", "attn_self"): v for k, v in s.items()}, "renamed")
    with pytest.raises(RefitError, match=r"32 of 64 LoRA key\(s\)") as err:
        lora_deltas(base_unet, [(renamed, 1.0)])
    assert "attn_self.to_q.lora_A.weight" in str(err.value)
    assert "has no weight down_blocks.1.attentions.0.transformer_blocks.0.attn_self.to_q.weight" in str(err.value)


def test_shape_mismatch_is_listed(base_unet, lora_a, rewrite_lora):
    def widen(state: dict) -> dict:
        target = "attn2.to_k.lora_A.weight"
        return {k: (torch.cat([v, v], dim=1) if k.endswith(target) else v) for k, v in state.items()}

    with pytest.raises(RefitError, match="do not fit the model's weight"):
        lora_deltas(base_unet, [(rewrite_lora(lora_a, widen, "widened"), 1.0)])


def test_text_encoder_weights_are_reported_not_applied(base_unet, lora_a, rewrite_lora, caplog):
    def add_text_encoder(state: dict) -> dict:
        extra = {"text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 32),
                 "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(32, 4)}
        return {**state, **extra}

    with_te = rewrite_lora(lora_a, add_text_encoder, "with-text-encoder")
    with caplog.at_level(logging.WARNING, logger="trt_diffusion.lora"):
        ours = lora_deltas(base_unet, [(with_te, 1.0)])
    assert "text_encoder: 2 keys" in caplog.text and "not applied" in caplog.text
    _assert_same(ours, lora_deltas(base_unet, [(lora_a, 1.0)]))


def test_text_encoder_only_lora_is_refused_for_the_unet(base_unet, lora_a, rewrite_lora):
    te_only = rewrite_lora(lora_a, lambda s: {k.replace("unet.", "text_encoder."): v for k, v in s.items()}, "te-only")
    with pytest.raises(RefitError, match="has no weights for the unet .*text_encoder: 64 keys"):
        lora_deltas(base_unet, [(te_only, 1.0)])


def test_unsupported_kinds_and_bad_inputs(base_unet, lora_a, rewrite_lora, tmp_path):
    dora = rewrite_lora(lora_a, lambda s: {**s, "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
                                                ".lora_magnitude_vector": torch.ones(16)}, "dora")
    with pytest.raises(RefitError, match="DoRA weights are not supported"):
        lora_deltas(base_unet, [(dora, 1.0)])
    with pytest.raises(RefitError, match="scale must be a finite number"):
        lora_deltas(base_unet, [(lora_a, float("nan"))])
    with pytest.raises(ModelError, match="does not exist"):
        lora_deltas(base_unet, [(tmp_path / "missing.safetensors", 1.0)])
    (tmp_path / "corrupt.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    with pytest.raises(ModelError, match="cannot read LoRA file"):
        read_lora_file(tmp_path / "corrupt.safetensors")


def _as_file(state: dict):
    """An in-memory LoRA (diffusers naming, `unet.` prefix) as a LoraFile."""
    from pathlib import Path

    from trt_diffusion.lora.files import LoraFile, detect_naming

    tensors = {f"unet.{k}": v for k, v in state.items()}
    return LoraFile(path=Path("<sdxl tiny lora>"), tensors=tensors, naming=detect_naming(list(tensors)))


def test_text_encoder_lora_on_the_text_encoder(sd15_dir, tmp_path, rewrite_lora, helpers):
    """Text-encoder weights are applied when asked for (`component="text_encoder"`): PEFT's merge agrees,
    in diffusers and in kohya naming (CLIP's q_proj / mlp.fc1 spellings)."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer as PeftLoraLayer
    from peft.utils import get_peft_model_state_dict

    from trt_diffusion.families import Component
    from trt_diffusion.lora import base_parameters
    from trt_diffusion.models.loading import load_component

    text_encoder = load_component(sd15_dir, Component.text_encoder)
    adapted = copy.deepcopy(text_encoder)
    torch.manual_seed(7)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "out_proj", "fc1"])
    adapted.add_adapter(config, adapter_name="te")
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(adapted, adapter_name="te").items()}
    StableDiffusionPipeline.save_lora_weights(tmp_path, text_encoder_lora_layers=state,
                                              text_encoder_lora_adapter_metadata=config.to_dict())
    lora = tmp_path / "pytorch_lora_weights.safetensors"
    for module in adapted.modules():
        if isinstance(module, PeftLoraLayer):
            module.merge()
    merged = base_parameters(adapted)

    ours = lora_deltas(text_encoder, [(lora, 1.0)], component="text_encoder")
    assert len(ours) == 3 * 2  # q_proj, out_proj, fc1 of two layers
    assert max((ours[n] - merged[n]).abs().max().item() for n in ours) <= FUSE_TOLERANCE
    unchanged = [n for n in merged if n not in ours]
    assert all(torch.equal(merged[n], text_encoder.get_parameter(n)) for n in unchanged)
    # files in the wild spell CLIP's `text_model.` level, which transformers 5 dropped
    def with_text_model(state: dict) -> dict:
        return {k.replace("text_encoder.", "text_encoder.text_model.", 1): v for k, v in state.items()}

    # (a rewritten file loses the adapter metadata: alpha = rank, so scale by lora_alpha / r = 2 to compare)
    spelled = rewrite_lora(lora, with_text_model, "te-text-model")
    _assert_same(lora_deltas(text_encoder, [(spelled, 2.0)], component="text_encoder"), ours)
    # kohya naming of the same LoRA (its alpha keys say alpha = rank)
    kohya = rewrite_lora(spelled, helpers.to_kohya, "te-kohya")
    assert next(iter(load_file(str(kohya)))).startswith("lora_te1_text_model_encoder_layers_")
    _assert_same(lora_deltas(text_encoder, [(kohya, 2.0)], component="text_encoder"), ours)
