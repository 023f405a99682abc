"""The tiny reference models: complete diffusers folders, deterministic, runnable on a CPU in seconds."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from trt_diffusion.cli import main

FAMILIES = ["sd15", "sdxl", "sd3", "flux"]
PIPELINES = {"sd15": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline",
             "sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_loads_and_generates(tiny_model_factory, family):
    folder = tiny_model_factory(family)
    pipe = DiffusionPipeline.from_pretrained(folder)
    assert type(pipe).__name__ == PIPELINES[family]
    kwargs = {"max_sequence_length": 32} if family in ("sd3", "flux") else {}
    # tiny by construction (what keeps every test over these models cheap), not by a stopwatch
    weights = sum(f.stat().st_size for f in folder.rglob("*.safetensors") if "lora" not in f.parts)
    assert weights < 4_000_000, weights
    image = pipe("a red cube on a table", num_inference_steps=3, height=64, width=64, output_type="np",
                 generator=torch.Generator().manual_seed(0), **kwargs).images[0]
    assert image.shape == (64, 64, 3) and np.isfinite(image).all()
    assert image.std() > 0.01  # not a flat image: the weights really do something


def _digest(folder) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*.safetensors")):
        h.update(path.relative_to(folder).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@pytest.mark.slow  # two interpreters building every family (~15 s)
def test_two_processes_write_identical_weights(tmp_path):
    for name in ("a", "b"):
        subprocess.run([sys.executable, "-m", "trt_diffusion", "models", "tiny", "--family", "sdxl",
                        "--controlnet", "--lora", "--out", str(tmp_path / name)], check=True, capture_output=True)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert (tmp_path / "a" / "controlnet" / "config.json").is_file()
    assert (tmp_path / "a" / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_controlnet_outputs_are_not_zero(tiny_sd15_dir):
    from diffusers import ControlNetModel

    controlnet = ControlNetModel.from_pretrained(tiny_sd15_dir / "controlnet")
    down, mid = controlnet(torch.randn(1, 4, 8, 8), torch.tensor([10.0]), torch.randn(1, 77, 32),
                           controlnet_cond=torch.rand(1, 3, 64, 64), return_dict=False)
    assert mid.abs().max() > 1e-3 and all(d.abs().max() > 1e-3 for d in down)


def test_existing_folder_is_not_overwritten_without_flag(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["models", "tiny", "--out", str(out)]) == 0
    assert main(["models", "tiny", "--out", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["models", "tiny", "--out", str(out), "--if-missing"]) == 0


def test_full_size_is_refused_for_the_families_without_one(tmp_path, capsys):
    assert main(["models", "tiny", "--family", "flux", "--size", "full", "--out", str(tmp_path / "x")]) == 1
    assert "sd15, sdxl, wan, qwen_image, flux2, flux2_klein only" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_full_size_wan_is_the_released_1_3b_transformer():
    """Built on the meta device (no 5.7 GB of weights): Wan-AI/Wan2.1-T2V-1.3B-Diffusers' transformer has
    1,418,996,800 parameters (5.68 GB of fp32 safetensors)."""
    from trt_diffusion.models.tiny_video import meta_parameter_count

    assert meta_parameter_count("full") == 1_418_996_800


def test_full_size_sdxl_unet_is_sdxl_base_architecture():
    """Built on the meta device (no 10 GB of weights): stabilityai/stable-diffusion-xl-base-1.0's UNet has
    2,567,463,684 parameters and takes the two text encoders' 768 + 1280 hidden sizes."""
    import torch

    from trt_diffusion.models.tiny import _sdxl_unet

    with torch.device("meta"):
        unet = _sdxl_unet("full")
    assert sum(p.numel() for p in unet.parameters()) == 2_567_463_684
    assert unet.config.cross_attention_dim == 2048
    assert unet.add_embedding.linear_1.in_features == 1280 + 6 * 256


@pytest.mark.parametrize("variant", ["i2v", "i2v_two_expert"])
def test_tiny_wan_image_to_video_is_what_diffusers_loads(tmp_path, variant):
    """Wan 2.1 I2V (a CLIP vision encoder the transformer cross-attends to) and Wan 2.2 I2V A14B (two experts, no
    image encoder): WanImageToVideoPipeline loads the folder and makes a clip from an image; the transformers take
    the 36 channels the pipeline concatenates (noise 16 + first-frame mask 4 + condition latents 16)."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    out = tmp_path / variant
    assert main(["models", "tiny", "--family", "wan", "--variant", variant, "--out", str(out)]) == 0
    pipe = WanImageToVideoPipeline.from_pretrained(out)
    assert pipe.transformer.config.in_channels == 36
    assert (pipe.image_encoder is not None) == (variant == "i2v")
    assert (pipe.transformer_2 is not None) == (variant == "i2v_two_expert")
    if variant == "i2v":
        assert pipe.transformer.config.image_dim == pipe.image_encoder.config.hidden_size
    image = Image.fromarray((np.random.RandomState(0).rand(32, 48, 3) * 255).astype(np.uint8))
    frames = pipe(image=image, prompt="a cat", height=32, width=48, num_frames=5, num_inference_steps=2,
                  generator=torch.Generator().manual_seed(1), output_type="np").frames
    assert frames.shape == (1, 5, 32, 48, 3) and np.isfinite(frames).all()
