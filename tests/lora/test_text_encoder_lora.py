"""Text-encoder LoRA (issue 17, acceptance 1): a kohya LoRA with UNet and text-encoder parts, refitted into the
onnxruntime engines, gives the images of diffusers' `load_lora_weights` + `fuse_lora`; its text-encoder part
visibly changes them; A -> B -> A leaves no residue in either engine; parts no engine takes are refused by name.

The LoRAs are made here as users bring them: kohya naming with the `lora_te_text_model_` spelling of real
files (transformers 5 dropped the `text_model.` level; both are matched), an alpha that is not the rank.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.errors import RefitError
from trt_diffusion.metrics import psnr
from trt_diffusion.runtime.loader import engine_runners, refit_weights
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.schedulers import make_scheduler

PROMPT = "a lighthouse on a cliff at dusk"
ARGS = dict(height=64, width=64, steps=4, guidance_scale=5.0, seed=7)
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def _peft_state(module, targets, seed, rank=4):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    module = copy.deepcopy(module)
    torch.manual_seed(seed)
    module.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=targets),
                       adapter_name="x")
    return {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(module, adapter_name="x").items()}


def _kohya(state: dict, alpha: float) -> dict:
    """diffusers' PEFT -> kohya converter, then SD1.5's `lora_te_` prefix and the `text_model_` level real files
    spell; every module's alpha set to `alpha` (scaling alpha / rank, as kohya applies it)."""
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya

    out = {}
    for key, value in convert_state_dict_to_kohya(state).items():
        key = key.replace("lora_te1_", "lora_te_")
        if key.startswith("lora_te_") and not key.startswith("lora_te_text_model_"):
            key = key.replace("lora_te_", "lora_te_text_model_", 1)
        out[key] = torch.tensor(alpha) if key.endswith(".alpha") else value
    return out


@pytest.fixture(scope="module")
def sd15_parts(tiny_sd15_dir):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir)
    return pipe.unet, pipe.text_encoder


@pytest.fixture(scope="module")
def loras(sd15_parts, tmp_path_factory):
    """kohya A: UNet + text encoder (alpha 2, rank 4); kohya A without its text-encoder part; kohya B: UNet +
    text encoder, other seed; PEFT-named C: text encoder only (diffusers' `save_lora_weights`)."""
    from diffusers import StableDiffusionPipeline

    unet, text_encoder = sd15_parts
    folder = tmp_path_factory.mktemp("te-loras")
    files = {}
    for name, seed in (("a", 11), ("b", 12)):
        state = {f"unet.{k}": v for k, v in _peft_state(unet, UNET_TARGETS, seed).items()}
        state.update({f"text_encoder.{k}": v for k, v in _peft_state(text_encoder, TE_TARGETS, seed + 50).items()})
        kohya = _kohya(state, alpha=2.0 if name == "a" else 6.0)
        save_file(kohya, str(folder / f"{name}.safetensors"))
        files[name] = folder / f"{name}.safetensors"
        if name == "a":
            save_file({k: v for k, v in kohya.items() if k.startswith("lora_unet_")}, str(folder / "a_unet.safetensors"))
            files["a_unet"] = folder / "a_unet.safetensors"
    StableDiffusionPipeline.save_lora_weights(folder / "c", text_encoder_lora_layers=_peft_state(
        text_encoder, ["q_proj", "v_proj"], 13))
    files["c"] = folder / "c" / "pytorch_lora_weights.safetensors"
    return files


@pytest.fixture(scope="module")
def config(built_sd15):
    return load_engines_file(built_sd15)


def _ours(config, loras):
    model_dir, family, table = engine_runners(config, "sd15-tiny", "onnxruntime", loras=loras)
    return EnginePipeline(model_dir, family, table)


def _images(pipe) -> np.ndarray:
    return pipe.generate(GenerationRequest(prompt=PROMPT, **ARGS)).images


def _diffusers_fused(model_dir, loras) -> np.ndarray:
    """The reference: diffusers' own pipeline, `load_lora_weights` of each file, the scales, `fuse_lora`."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    names = [f"l{i}" for i in range(len(loras))]
    for name, (path, _) in zip(names, loras):
        pipe.load_lora_weights(str(path), adapter_name=name)
    pipe.set_adapters(names, [scale for _, scale in loras])
    pipe.fuse_lora(adapter_names=names)
    pipe.scheduler = make_scheduler("default", dict(pipe.scheduler.config), "sd15")
    images = pipe(PROMPT, height=ARGS["height"], width=ARGS["width"], num_inference_steps=ARGS["steps"],
                  guidance_scale=ARGS["guidance_scale"], generator=torch.Generator().manual_seed(ARGS["seed"]),
                  output_type="np").images
    return (images * 255).round().astype(np.uint8)


def _text_output(pipe) -> np.ndarray:
    runner = pipe.runners.find("text_encoder", size=None, batch=1)
    ids = np.random.default_rng(0).integers(0, 500, size=(1, 77)).astype(np.int64)
    return runner.run({"input_ids": ids})["hidden_states"]


def _unet_output(pipe) -> np.ndarray:
    runner = pipe.runners.find("unet", size=None, batch=2)
    rng = np.random.default_rng(0)
    feeds = {name: np.zeros([d or 1 for d in spec.shape], spec.dtype) for name, spec in runner.inputs.items()}
    for name in ("sample", "encoder_hidden_states"):
        feeds[name] = rng.standard_normal(feeds[name].shape).astype(np.float32)
    feeds["timestep"] = np.full(feeds["timestep"].shape, 500.0, np.float32)
    return runner.run(feeds)["noise_pred"]


def test_text_encoder_engine_is_refittable(config):
    from trt_diffusion.runtime.loader import built_engines

    engines = {e.spec.component: e for e in built_engines(config, "sd15-tiny", "onnxruntime")}
    assert engines["text_encoder"].spec.refittable and (engines["text_encoder"].path / "refit_map.json").is_file()
    assert not engines["vae_decoder"].spec.refittable


def test_kohya_lora_with_text_encoder_part_gives_diffusers_images(config, loras, tiny_sd15_dir):
    chosen = [(loras["a"], 0.8)]
    mine = _images(_ours(config, chosen))
    reference = _diffusers_fused(tiny_sd15_dir, chosen)
    print(f"engines vs diffusers' fused pipeline: {psnr(reference, mine):.1f} dB")
    assert psnr(reference, mine) >= 40.0, psnr(reference, mine)


def test_stacked_loras_with_their_scales_give_diffusers_images(config, loras, tiny_sd15_dir):
    chosen = [(loras["a"], 0.7), (loras["b"], -0.4), (loras["c"], 1.3)]
    mine = _images(_ours(config, chosen))
    reference = _diffusers_fused(tiny_sd15_dir, chosen)
    print(f"engines vs diffusers' fused pipeline: {psnr(reference, mine):.1f} dB")
    assert psnr(reference, mine) >= 40.0, psnr(reference, mine)


def test_the_text_encoder_part_visibly_changes_the_images(config, loras):
    full = _images(_ours(config, [(loras["a"], 1.0)]))
    unet_only = _images(_ours(config, [(loras["a_unet"], 1.0)]))
    base = _images(_ours(config, None))
    # measured 34.8 dB, max 20+ levels: far beyond the engines' distance to diffusers (inf, >= 40 dB above)
    changed = np.abs(unet_only.astype(int) - full.astype(int))
    print(f"text-encoder part: {psnr(unet_only, full):.1f} dB, max {changed.max()} levels; UNet part: "
          f"{psnr(base, unet_only):.1f} dB")
    assert psnr(unet_only, full) < 38.0 and changed.max() >= 8, (psnr(unet_only, full), changed.max())
    assert psnr(base, unet_only) < 38.0  # the UNet part changes them too


def test_a_b_a_leaves_no_residue_in_either_engine(config, loras):
    a, b = [(loras["a"], 1.0)], [(loras["b"], 1.0)]
    first = _ours(config, a)
    text_a, unet_a = _text_output(first), _unet_output(first)
    middle = _ours(config, b)
    assert np.abs(_text_output(middle) - text_a).max() > 1e-3
    assert np.abs(_unet_output(middle) - unet_a).max() > 1e-3
    again = _ours(config, a)
    np.testing.assert_array_equal(_text_output(again), text_a)
    np.testing.assert_array_equal(_unet_output(again), unet_a)
    # a LoRA with no text-encoder part leaves the text encoder exactly at base
    base, unet_part = _ours(config, None), _ours(config, [(loras["a_unet"], 1.0)])
    np.testing.assert_array_equal(_text_output(unet_part), _text_output(base))
    zero = _ours(config, [(loras["a"], 0.0)])
    np.testing.assert_array_equal(_text_output(zero), _text_output(base))
    np.testing.assert_array_equal(_unet_output(zero), _unet_output(base))


def test_cli_refit_covers_the_text_encoder_engine(built_sd15, loras, capsys):
    from trt_diffusion.cli import main

    assert main(["refit", str(built_sd15), "--model", "sd15-tiny", "--lora", f"{loras['a']}:0.5"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "sd15-tiny.text_encoder.b1.fp32" in out and "sd15-tiny.unet.64x64.b2.fp32" in out


def _write(tmp_path, write_engines_yaml, model_dir, family, **fields):
    return load_engines_file(write_engines_yaml(tmp_path, model_dir, family, name="m", **fields))


def test_text_encoder_part_without_a_text_encoder_engine_is_refused(tmp_path, write_engines_yaml, tiny_sd15_dir,
                                                                     loras):
    config = _write(tmp_path, write_engines_yaml, tiny_sd15_dir, "sd15", components=["unet", "vae_decoder"])
    with pytest.raises(RefitError, match=r"(?s)a\.safetensors: its text_encoder part \(\d+ keys\): m builds no "
                                         r"text_encoder engine.*none of it is applied|none of it is applied.*"
                                         r"text_encoder part"):
        refit_weights(config, "m", [(loras["a"], 1.0)])


def test_a_t5_part_is_refused_by_name(tmp_path, write_engines_yaml, tiny_model_factory):
    """FLUX's text_encoder_2 is T5: diffusers does not load LoRA weights into it, neither does this tool."""
    flux = tiny_model_factory("flux")
    config = _write(tmp_path, write_engines_yaml, flux, "flux")
    lora = tmp_path / "t5.safetensors"
    save_file({"text_encoder_2.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": torch.ones(2, 64),
               "text_encoder_2.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight": torch.ones(64, 2)}, str(lora))
    with pytest.raises(RefitError, match=r"t5\.safetensors: its text_encoder_2 part \(2 keys\): the flux family's "
                                         r"text_encoder_2 takes no LoRA weights"):
        refit_weights(config, "m", [(lora, 1.0)])


def test_a_controlnet_part_is_refused_by_name(tmp_path, config, loras):
    lora = tmp_path / "cn.safetensors"
    save_file({"controlnet.conv_in.lora_A.weight": torch.ones(2, 4, 3, 3),
               "controlnet.conv_in.lora_B.weight": torch.ones(8, 2, 1, 1)}, str(lora))
    with pytest.raises(RefitError, match="its controlnet part"):
        refit_weights(config, "sd15-tiny", [(loras["a"], 1.0), (lora, 1.0)])
