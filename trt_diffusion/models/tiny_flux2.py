"""Tiny seeded FLUX.2 pipelines: `Flux2Pipeline` (FLUX.2 dev: a Mistral-3 encoder, embedded guidance) and
`Flux2KleinPipeline` (FLUX.2 Klein: a Qwen3 encoder, true CFG), and the released transformers on the meta device.

The same contract as `tiny.py`: a complete diffusers folder the pipeline class loads, weights from a fixed seed.

Both pipelines stack the encoder's hidden states at fixed layers — (10, 20, 30) for FLUX.2, (9, 18, 27) for Klein,
their `text_encoder_out_layers` defaults — so the tiny encoders have 30 and 27 layers (narrow ones): the defaults
then hold for the tiny folders as for the released checkpoints, and no code path knows it runs a tiny model.

Tokenizers are built offline. FLUX.2's real tokenizer is a PixtralProcessor (it imports torchvision, absent here);
a byte-level `PreTrainedTokenizerFast` with Mistral's chat template (system and user turns, list content) takes its
place: `Flux2Pipeline._get_mistral_3_small_prompt_embeds` calls only `apply_chat_template`. Klein's is a Qwen2
tokenizer with Qwen3's template (`enable_thinking=False` adds the empty think block).
"""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError

FLUX2_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers default
KLEIN_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's
TEXT_HIDDEN = 16  # the tiny encoders' width: the transformer attends to 3 × 16 = 48 features

# black-forest-labs/FLUX.2-dev transformer/config.json (diffusers' defaults are the released values)
FLUX2_TRANSFORMER = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                         num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256,
                         mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=True)
# black-forest-labs/FLUX.2-klein-4B transformer/config.json
KLEIN_TRANSFORMER = dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                         num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256,
                         mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=False)
TINY_TRANSFORMER = dict(patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=3 * TEXT_HIDDEN, timestep_guidance_channels=32,
                        mlp_ratio=2.0, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000)
# FLUX.2-dev scheduler/scheduler_config.json (the pipeline computes mu itself: compute_empirical_mu)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)
QWEN3_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def mistral_tokenizer():
    """A byte-level PreTrainedTokenizerFast with Mistral's specials and chat template (every byte one token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in bytes_to_unicode().values():
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>", additional_special_tokens=specials[4:])
    tokenizer.chat_template = MISTRAL_TEMPLATE
    tokenizer.model_max_length = 131072
    return tokenizer


def qwen3_tokenizer():
    from .tiny_qwen import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]})
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


def mistral_text_encoder(tokenizer, layers: int = FLUX2_LAYERS[-1], hidden: int = TEXT_HIDDEN, intermediate: int = 24):
    """A tiny Mistral3ForConditionalGeneration (a Pixtral vision tower it is not asked to run)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    vocab = len(tokenizer)
    text_config = dict(model_type="mistral", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1_000_000_000.0,
                       sliding_window=None, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision_config = dict(model_type="pixtral", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, head_dim=8, image_size=28, patch_size=14)
    config = Mistral3Config(text_config=text_config, vision_config=vision_config, image_token_index=vocab - 1,
                            spatial_merge_size=2, vision_feature_layer=-1)
    return Mistral3ForConditionalGeneration(config)


def qwen3_text_encoder(tokenizer, layers: int = KLEIN_LAYERS[-1], hidden: int = TEXT_HIDDEN, intermediate: int = 24):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return Qwen3ForCausalLM(config)


def flux2_vae():
    from diffusers import AutoencoderKLFlux2

    # four blocks: the released 8x spatial factor (Flux2Pipeline.vae_scale_factor), tiny channel counts
    return AutoencoderKLFlux2(block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=32,
                              norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 4,
                              up_block_types=("UpDecoderBlock2D",) * 4)


def flux2_transformer(size: str = "tiny", klein: bool = False):
    from diffusers import Flux2Transformer2DModel

    if size == "full":
        return Flux2Transformer2DModel(**(KLEIN_TRANSFORMER if klein else FLUX2_TRANSFORMER))
    return Flux2Transformer2DModel(**TINY_TRANSFORMER, guidance_embeds=not klein)


def meta_parameter_count(klein: bool = False) -> int:
    """The released transformer's parameter count, built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in flux2_transformer("full", klein).parameters())


def refuse_full_size(klein: bool, available_bytes: int | None = None) -> None:
    """--size full: FLUX.2 dev's 32B transformer (Klein 4B's 3.9B) in fp32, beside a 24B (8B) encoder."""
    count = meta_parameter_count(klein)
    needed = 4 * count
    available = available_bytes if available_bytes is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    name, encoder, repo = (("FLUX.2 Klein 4B", "Qwen3 4B", "black-forest-labs/FLUX.2-klein-4B") if klein
                           else ("FLUX.2 dev", "24B Mistral-3", "black-forest-labs/FLUX.2-dev"))
    if available < needed:
        raise ConfigError(
            f"--size full: the {name} transformer has {count / 1e9:.1f}B parameters (checked on the meta device): "
            f"{needed / 1e9:.0f} GB of fp32 weights to build and write ({2 * count / 1e9:.0f} GB in bf16), beside the "
            f"{encoder} encoder's; this machine has {available / 1e9:.0f} GB of memory. Build it on a host with more "
            f"than {needed / 1e9:.0f} GB of RAM, or export the released checkpoint ({repo}) on one")


def build_tiny_flux2(seed: int = 0, size: str = "tiny", variant: str | None = None, *, klein: bool = False):
    """A seeded Flux2Pipeline (or Flux2KleinPipeline). `size="full"`: the released transformer with the tiny encoder
    widened to the features it attends to, where the machine can hold it (else a ConfigError)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline

    if variant is not None:
        raise ConfigError(f"no tiny flux2{'_klein' if klein else ''} model of variant {variant!r} (it has none)")
    if size == "full":
        refuse_full_size(klein)
    torch.manual_seed(seed)
    hidden = (KLEIN_TRANSFORMER if klein else FLUX2_TRANSFORMER)["joint_attention_dim"] // 3 if size == "full" \
        else TEXT_HIDDEN
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    if klein:
        tokenizer = qwen3_tokenizer()
        return Flux2KleinPipeline(scheduler=scheduler, vae=flux2_vae(), tokenizer=tokenizer,
                                  text_encoder=qwen3_text_encoder(tokenizer, hidden=hidden),
                                  transformer=flux2_transformer(size, klein=True), is_distilled=False)
    tokenizer = mistral_tokenizer()
    return Flux2Pipeline(scheduler=scheduler, vae=flux2_vae(), tokenizer=tokenizer,
                         text_encoder=mistral_text_encoder(tokenizer, hidden=hidden),
                         transformer=flux2_transformer(size))
