"""A tiny seeded Qwen-Image pipeline (and the released Qwen-Image transformer's architecture, on the meta device).

The same contract as `tiny.py`: a complete diffusers folder `QwenImagePipeline.from_pretrained` loads (scheduler,
Qwen2.5-VL text encoder, Qwen2 tokenizer, the Wan-style 3D VAE, the MMDiT), weights from a fixed seed.

The tokenizer is built offline: a byte-level BPE (every byte a token) plus Qwen's chat special tokens and merges
that make each word of diffusers' prompt template one token. QwenImagePipeline drops the first 34 positions of the
encoder's hidden states (`prompt_template_encode_start_idx`: what the real Qwen tokenizer makes of the template's
system part), so the tiny tokenizer must tokenize that prefix to exactly 34 tokens too, or the prompt's own states
would be cut (tests/models/test_tiny_qwen.py checks it).
"""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError
from ..families import QWEN_EDIT_TEMPLATE_PREFIX, QWEN_TEMPLATE_TOKENS

# diffusers' QwenImagePipeline.prompt_template_encode, the part before the prompt
TEMPLATE_PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5-VL's vision placeholders, in the edit variant's tokenizer: QwenImageEditPipeline's template has the
# reference image's tokens (<|image_pad|> repeated by the processor) between <|vision_start|> and <|vision_end|>
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen/Qwen-Image-Edit processor/preprocessor_config.json (Qwen2.5-VL-7B-Instruct's)
EDIT_IMAGE_PROCESSOR = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2, merge_size=2,
                            image_mean=[0.48145466, 0.4578275, 0.40821073],
                            image_std=[0.26862954, 0.26130258, 0.27577711])
TEXT_HIDDEN = 32  # the tiny encoder's width: the transformer's joint_attention_dim

# Qwen/Qwen-Image transformer/config.json (diffusers' defaults are the released values)
QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)
QWEN_IMAGE_TRANSFORMER_PARAMETERS = 20_430_401_088  # the released transformer's count (checked on the meta device)
TINY_TRANSFORMER = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=TEXT_HIDDEN, guidance_embeds=False, axes_dims_rope=(4, 6, 6),
)
# Qwen/Qwen-Image scheduler/scheduler_config.json
SCHEDULER = dict(
    base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, num_train_timesteps=1000,
    shift=1.0, shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True,
)


def qwen_tokenizer(edit: bool = False):
    """An offline Qwen2Tokenizer: byte-level BPE, Qwen's special tokens, one token per template word. `edit`: the
    edit template's words too (its system part tokenizes to the 64 positions QwenImageEditPipeline drops), and the
    vision placeholders."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(byte_chars)}
    merges: list[tuple[str, str]] = []
    to_bytes = bytes_to_unicode()
    for word in _template_words(QWEN_EDIT_TEMPLATE_PREFIX if edit else None):
        symbols = "".join(to_bytes[b] for b in word.encode())
        if edit and symbols not in vocab and symbols[1:] in vocab:  # " user" after "user": BPE merges "user" first
            merges.append((symbols[0], symbols[1:]))
            vocab[symbols] = len(vocab)
            continue
        for end in range(2, len(symbols) + 1):  # left to right: each word merges into one token
            left, right = symbols[:end - 1], symbols[end - 1]
            if symbols[:end] not in vocab:
                merges.append((left, right))
                vocab[symbols[:end]] = len(vocab)
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:] + (VISION_TOKENS if edit else ()))})
    tokenizer.model_max_length = 32768  # Qwen2.5-VL's tokenizer_config.json
    return tokenizer


def _template_words(edit_prefix: str | None = None) -> list[str]:
    """The templates' pre-tokens (Qwen's regex keeps a word's leading space and splits off "'s"), specials aside."""
    import re

    text = TEMPLATE_PREFIX + "<|im_end|>\n<|im_start|>assistant\n" + (edit_prefix or "")
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "\n")
    words = re.findall(r"'s| ?[A-Za-z]+| ?[^\sA-Za-z]+", text)
    return list(dict.fromkeys(w for w in words if len(w) > 1))


def qwen_text_encoder(hidden: int = TEXT_HIDDEN, vocab_size: int = 512, tokenizer=None, layers: int = 2,
                      intermediate: int = 37):
    """A tiny Qwen2_5_VLForConditionalGeneration (transformers 5: rope_parameters carries the mrope_section)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    heads, head_dim = 4, hidden // 4
    text_config = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>") if tokenizer else None,
        pad_token_id=tokenizer.pad_token_id if tokenizer else None,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                         "mrope_section": [head_dim // 8, head_dim // 8, head_dim // 4]},
    )
    vision_config = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden,
                         patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                         fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, bos_token_id=None,
                              eos_token_id=text_config["eos_token_id"], pad_token_id=text_config["pad_token_id"],
                              **_vision_token_ids(tokenizer, vocab_size))
    return Qwen2_5_VLForConditionalGeneration(config)


def _vision_token_ids(tokenizer, vocab_size: int) -> dict[str, int]:
    """The config's placeholder ids: the tokenizer's vision tokens where it has them (the edit variant), else the
    top of the vocabulary (no prompt of the text-to-image tokenizer reaches them)."""
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    if tokenizer is not None and VISION_TOKENS[0] in tokenizer.get_vocab():
        return dict(zip(names, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    return dict(zip(names, (vocab_size - 3, vocab_size - 4, vocab_size - 1, vocab_size - 2)))


def qwen_vae():
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                  temperal_downsample=[False, True, True])


def qwen_transformer(size: str = "tiny"):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(**(QWEN_IMAGE_TRANSFORMER if size == "full" else TINY_TRANSFORMER))


def meta_parameter_count(size: str = "full") -> int:
    """The transformer's parameter count, built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in qwen_transformer(size).parameters())


def refuse_full_size(available_bytes: int | None = None) -> None:
    """--size full: the 20B transformer's fp32 weights are 82 GB; refuse where the machine cannot hold them."""
    count = meta_parameter_count("full")
    needed = 4 * count  # fp32, as the tiny models are written
    available = available_bytes if available_bytes is not None else _memory_bytes()
    if available < needed:
        raise ConfigError(
            f"--size full: the Qwen-Image transformer has {count / 1e9:.1f}B parameters (checked on the meta device): "
            f"{needed / 1e9:.0f} GB of fp32 weights to build and write ({2 * count / 1e9:.0f} GB in bf16), beside the "
            f"7B Qwen2.5-VL encoder's; this machine has {available / 1e9:.0f} GB of memory. Build it on a host with "
            f"more than {needed / 1e9:.0f} GB of RAM, or export the released checkpoint (Qwen/Qwen-Image) on one")


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def edit_processor(tokenizer, image_processor=None):
    """The `processor` QwenImageEditPipeline takes (a Qwen2VLProcessor), without its video part.

    transformers 5's Qwen2VLProcessor checks its video processor's class through a mapping that exists only with
    torchvision installed, so on a CPU host without torchvision it cannot be built at all; the edit prompt never
    carries a video, so this processor is built from the image processor and the tokenizer alone, and its
    `__call__` is Qwen2VLProcessor's."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    return ImageOnlyQwen2VLProcessor(image_processor or Qwen2VLImageProcessorPil(**EDIT_IMAGE_PROCESSOR), tokenizer,
                                     None)


def build_tiny_qwen_image(seed: int = 0, size: str = "tiny", variant: str | None = None):
    """A seeded QwenImagePipeline (`variant="edit"`: a QwenImageEditPipeline, its encoder's vision tower used and
    its tokenizer with the vision placeholders). `size="full"`: the released 20B transformer (random weights) with
    the tiny encoder widened to the 3584 features it attends to, where the machine can hold it (else a
    ConfigError)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImagePipeline

    if variant not in (None, "edit"):
        raise ConfigError(f"no tiny qwen_image model of variant {variant!r} (variants: edit)")
    if size == "full":
        refuse_full_size()
    torch.manual_seed(seed)
    hidden = QWEN_IMAGE_TRANSFORMER["joint_attention_dim"] if size == "full" else TEXT_HIDDEN
    edit = variant == "edit"
    tokenizer = qwen_tokenizer(edit=edit)
    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=qwen_vae(),
                 text_encoder=qwen_text_encoder(hidden, tokenizer=tokenizer), tokenizer=tokenizer,
                 transformer=qwen_transformer(size))
    if not edit:
        return QwenImagePipeline(**parts)
    return QwenImageEditPipeline(**parts, processor=edit_processor(tokenizer))


def fix_processor_entry(model_dir) -> None:
    """model_index.json and the processor's config name the processor as released checkpoints do (transformers'
    Qwen2VLProcessor), not as the image-only subclass `edit_processor` builds (each records the object's class)."""
    import json
    from pathlib import Path

    for path, key, value in ((Path(model_dir) / "model_index.json", "processor", ["transformers", "Qwen2VLProcessor"]),
                             (Path(model_dir) / "processor" / "processor_config.json", "processor_class",
                              "Qwen2VLProcessor")):
        data = json.loads(path.read_text())
        data[key] = value
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


__all__ = ["QWEN_TEMPLATE_TOKENS", "build_tiny_qwen_image", "meta_parameter_count", "qwen_tokenizer"]
