"""The reference configs shipped for single files without `config:` (issue 17): runwayml/stable-diffusion-v1-5's
components and CLIP's tokenizer, rebuilt from OpenAI's BPE file.

The parameter counts are those of the released SD1.5 components, so a wrong channel count, layer count or
head size in a shipped config fails here; the slow test writes a single file with SD1.5's real shapes
(random weights) and reads it back through the shipped configs alone, weight for weight.
"""

from __future__ import annotations

import json

import pytest
import torch

from trt_diffusion.models.single_file import convert_single_file, reference_clip_tokenizer, reference_config_dir

SD15 = reference_config_dir("sd15")
# Parameter counts of the released SD1.5 components (diffusers / transformers state dicts).
SD15_PARAMETERS = {"unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480}


def _empty_sd15_components() -> dict:
    """SD1.5's components from the shipped configs, with weights on the meta device (no memory)."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    with init_empty_weights():
        return {"unet": UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(SD15 / "unet")),
                "vae": AutoencoderKL.from_config(AutoencoderKL.load_config(SD15 / "vae")),
                "text_encoder": CLIPTextModel(CLIPTextConfig.from_pretrained(SD15 / "text_encoder"))}


def test_the_shipped_sd15_configs_have_the_released_architecture():
    components = _empty_sd15_components()
    assert {name: sum(p.numel() for p in module.parameters()) for name, module in components.items()} \
        == SD15_PARAMETERS
    index = json.loads((SD15 / "model_index.json").read_text())
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"] and index["safety_checker"] == [None, None]


def test_the_rebuilt_clip_tokenizer_gives_clips_token_ids():
    tokenizer = reference_clip_tokenizer()
    assert len(tokenizer) == 49408
    # ids of openai/clip-vit-large-patch14's tokenizer: <|startoftext|> a photo of a cat <|endoftext|>
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert tokenizer("An ASTRONAUT riding a horse").input_ids == [49406, 550, 18376, 6765, 320, 4558, 49407]
    assert len(tokenizer("x", padding="max_length").input_ids) == 77


@pytest.mark.slow
def test_a_full_size_sd15_single_file_reads_back_through_the_shipped_configs_alone(tmp_path):
    """~2 GB written and 4 GB read back: SD1.5's real shapes, random weights, no `config:`."""
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from safetensors.torch import save_file
    from transformers import CLIPTextConfig, CLIPTextModel

    from trt_diffusion.models.single_file import to_original_layout
    from trt_diffusion.models.tiny import build_tiny_pipeline

    torch.manual_seed(0)
    parts = {"unet": UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(SD15 / "unet")),
             "vae": AutoencoderKL.from_config(AutoencoderKL.load_config(SD15 / "vae")),
             "text_encoder": CLIPTextModel(CLIPTextConfig.from_pretrained(SD15 / "text_encoder"))}
    pipe = build_tiny_pipeline("sd15")  # its scheduler and tokenizer; the three networks replaced
    for name, module in parts.items():
        setattr(pipe, name, module.half().eval())  # fp16: how SD1.5 single files are distributed
    file = tmp_path / "sd15-random.safetensors"
    save_file({k: v.contiguous() for k, v in to_original_layout(pipe).items()}, str(file))

    out = convert_single_file(file, tmp_path / "converted", family="sd15")
    back = StableDiffusionPipeline.from_pretrained(out)
    for name, module in parts.items():
        mine, theirs = module.state_dict(), getattr(back, name).state_dict()
        buffers = {"text_model.embeddings.position_ids"}  # a buffer some transformers versions do not save
        assert set(mine) - buffers == set(theirs) - buffers
        for key, value in mine.items():
            if key in theirs:
                assert torch.equal(value.float(), theirs[key]), f"{name}.{key}"
    assert back.tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
