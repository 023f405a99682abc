"""The tiny Qwen-Image pipeline: a folder QwenImagePipeline loads and runs, a tokenizer whose template prefix is the
34 tokens the pipeline drops, seeded weights, the released transformer's size on the meta device (and --size full
refused where it does not fit), the real-valued RoPE identical to diffusers' complex one, and the host's
prompt-embeds arithmetic equal to diffusers' encode_prompt."""

from __future__ import annotations

import pytest
import torch

from trt_diffusion.cli import main
from trt_diffusion.errors import ConfigError
from trt_diffusion.families import QWEN_TEMPLATE_TOKENS, Family, family_info, family_of_pipeline_class
from trt_diffusion.models import tiny_qwen


@pytest.fixture(scope="module")
def qwen_dir(tiny_model_factory):
    return tiny_model_factory("qwen_image")


@pytest.fixture(scope="module")
def pipe(qwen_dir):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(qwen_dir)


def test_the_template_prefix_is_the_34_tokens_the_pipeline_drops(pipe):
    """QwenImagePipeline drops the first 34 positions; the tiny tokenizer must make the template's system part
    exactly that long, and the prompt must start right after it."""
    template = pipe.prompt_template_encode
    assert pipe.prompt_template_encode_start_idx == QWEN_TEMPLATE_TOKENS
    assert template.startswith(tiny_qwen.TEMPLATE_PREFIX)
    tokenizer = pipe.tokenizer
    prefix = tokenizer(tiny_qwen.TEMPLATE_PREFIX)["input_ids"]
    assert len(prefix) == QWEN_TEMPLATE_TOKENS
    full = tokenizer(template.format("a red cat"))["input_ids"]
    assert full[:QWEN_TEMPLATE_TOKENS] == prefix
    assert tokenizer.decode(full[QWEN_TEMPLATE_TOKENS:]).startswith("a red cat<|im_end|>")
    assert len(tokenizer(template.format(""))["input_ids"]) == QWEN_TEMPLATE_TOKENS + 5  # the template's tail
    assert tokenizer.padding_side == "right"


def test_the_folder_loads_as_a_qwen_image_pipeline_and_generates_64x64(qwen_dir, pipe):
    assert family_of_pipeline_class(type(pipe).__name__) is Family.qwen_image
    assert family_info("qwen_image").latent_factor == pipe.vae_scale_factor * 2 == 16
    generator = torch.Generator().manual_seed(0)
    image = pipe("a red cat", negative_prompt="blurry", true_cfg_scale=4.0, height=64, width=64,
                 num_inference_steps=2, output_type="np", generator=generator).images
    assert image.shape == (1, 64, 64, 3) and 0.0 <= image.min() < image.max() <= 1.0


def test_builds_are_seeded():
    a, b = (tiny_qwen.build_tiny_qwen_image(seed=3) for _ in range(2))
    for name in ("transformer", "text_encoder", "vae"):
        left, right = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert all(torch.equal(left[k], right[k]) for k in left), name


def test_full_size_is_the_released_20b_transformer():
    """Built on the meta device (no 82 GB of weights): Qwen/Qwen-Image's transformer (60 blocks of 24 × 128 heads,
    a 3584-wide text stream) has 20.43B parameters."""
    assert tiny_qwen.meta_parameter_count("full") == tiny_qwen.QWEN_IMAGE_TRANSFORMER_PARAMETERS == 20_430_401_088


def test_full_size_is_refused_where_its_weights_do_not_fit(tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match=r"20\.4B parameters.*82 GB of fp32 weights.*41 GB in bf16.*has 24 GB"):
        tiny_qwen.refuse_full_size(available_bytes=24 * 10**9)
    tiny_qwen.refuse_full_size(available_bytes=100 * 10**9)  # a host that can hold it builds it
    monkeypatch.setattr(tiny_qwen, "_memory_bytes", lambda: 24 * 10**9)  # this CI class of machine, whatever runs it
    out = tmp_path / "full"
    assert main(["models", "tiny", "--family", "qwen_image", "--size", "full", "--out", str(out)]) == 1
    err = capsys.readouterr()
    assert "82 GB of fp32 weights" in err.out + err.err and "Traceback" not in err.out + err.err
    assert not out.exists()


def test_the_real_rotary_embedding_is_identical_to_the_complex_one(pipe):
    """The export's RoPE (real cos/sin, a symbolic text length) against diffusers' complex one: the same bits, at a
    padded mask and an odd patch grid; the originals are back afterwards."""
    from diffusers.models.transformers import transformer_qwenimage as qwen

    from trt_diffusion.components.qwen_image import real_rotary_embeddings
    from trt_diffusion.quantize.trace_patches import trace_patches

    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 3 * 5, 64, generator=generator)
    text = torch.randn(2, 7, pipe.transformer.config.joint_attention_dim, generator=generator)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    kwargs = dict(hidden_states=latents, encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                  timestep=torch.tensor([0.3, 0.7]), img_shapes=[[(1, 3, 5)]] * 2, return_dict=False)
    originals = (qwen.QwenEmbedRope.forward, qwen.apply_rotary_emb_qwen, qwen.compute_text_seq_len_from_mask)
    with torch.no_grad():
        expected = pipe.transformer(**kwargs)[0]
        with real_rotary_embeddings():
            assert qwen.apply_rotary_emb_qwen is not originals[1]
            patched = pipe.transformer(**kwargs)[0]
    assert torch.equal(patched, expected)
    assert (qwen.QwenEmbedRope.forward, qwen.apply_rotary_emb_qwen, qwen.compute_text_seq_len_from_mask) == originals
    with trace_patches(pipe.transformer, Family.qwen_image):  # the quantized (legacy) trace gets the same rewrite
        assert qwen.apply_rotary_emb_qwen is not originals[1]
    assert qwen.apply_rotary_emb_qwen is originals[1]


def test_the_hosts_prompt_embeds_equal_diffusers_encode_prompt(pipe):
    """What the runtime does with the encoder engine's whole-sequence states (components/qwen_image.py's
    prompt_embeds), here on torch's states: diffusers' encode_prompt exactly, for a batch of unequal prompts and a
    max_sequence_length that cuts."""
    from trt_diffusion.components.qwen_image import prompt_embeds

    prompts = ["a red cat on a mat", "sky"]
    tokens = pipe.tokenizer([pipe.prompt_template_encode.format(p) for p in prompts],
                            max_length=1024 + QWEN_TEMPLATE_TOKENS, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        states = pipe.text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                                   output_hidden_states=True).hidden_states[-1]
        for length in (512, 9):
            expected, expected_mask = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=length)
            embeds, mask = prompt_embeds(states.numpy(), tokens.attention_mask.numpy(), length)
            assert (embeds == expected.numpy()).all() and embeds.shape == tuple(expected.shape)
            if expected_mask is None:  # diffusers passes an all-ones mask as None
                assert mask.all()
            else:
                assert (mask == expected_mask.numpy()).all()


def test_the_edit_variant_drops_64_template_tokens_and_names_its_vision_tokens(tiny_model_factory):
    """The edit tokenizer makes QwenImageEditPipeline's system part the 64 positions it drops (Qwen's "'s" is one
    pre-token, as in the real tokenizer), its vision placeholders are the encoder config's ids, and the folder names
    its processor as released checkpoints do."""
    import json

    from transformers import AutoTokenizer

    from trt_diffusion.families import QWEN_EDIT_TEMPLATE_PREFIX, QWEN_EDIT_TEMPLATE_TOKENS

    folder = tiny_model_factory("qwen_image", variant="edit")
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    assert len(tokenizer(QWEN_EDIT_TEMPLATE_PREFIX).input_ids) == QWEN_EDIT_TEMPLATE_TOKENS
    config = json.loads((folder / "text_encoder" / "config.json").read_text())
    ids = tokenizer.convert_tokens_to_ids(list(tiny_qwen.VISION_TOKENS))
    assert ids == [config[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                       "video_token_id")]
    assert max(ids) < config["text_config"]["vocab_size"]
    assert json.loads((folder / "model_index.json").read_text())["processor"] == ["transformers", "Qwen2VLProcessor"]
    assert json.loads((folder / "processor" / "processor_config.json").read_text())["processor_class"] == \
        "Qwen2VLProcessor"
    # the text-to-image tokenizer is unchanged: still 34 template tokens
    assert len(tiny_qwen.qwen_tokenizer()(tiny_qwen.TEMPLATE_PREFIX).input_ids) == QWEN_TEMPLATE_TOKENS
