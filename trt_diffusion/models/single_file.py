"""Single-file checkpoints: one `.safetensors` in the original (A1111 / ComfyUI, "LDM") layout.

`convert_single_file(file, out, config=None)` loads it offline through diffusers' own single-file loading
(`StableDiffusionPipeline.from_single_file(..., config=<a local diffusers folder>, local_files_only=True)`) and
writes a diffusers folder that everything else reads (export, quantize, the reference, refit). The config is
the folder `config:` names, else the family's reference configs shipped with the package
(`trt_diffusion/data/reference_configs/<family>/`). Pickled `.ckpt` files are refused, as for LoRAs.

`to_original_layout(pipe)` is the inverse key mapping (diffusers -> LDM) for SD1.5-layout pipelines: the tests
write single files from the tiny models with it and check the round trip weight for weight.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ModelError
from ..families import FAMILIES, family_info
from ..workspace.files import sha256_file, staged_folder

SINGLE_FILE_MANIFEST = "trt_diffusion_single_file.json"
UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_PREFIX = "cond_stage_model.transformer.text_model."
# Keys that tell the families apart (diffusers' CHECKPOINT_KEY_NAMES, in short): their declarations'
# `single_file_keys`, family name -> (a key it holds, a prefix of others)
FAMILY_MARKERS = {family.value: info.single_file_keys for family, info in FAMILIES.items() if info.single_file_keys}


REFERENCE_CONFIGS = Path(__file__).resolve().parent.parent / "data" / "reference_configs"
CLIP_BPE_FILE = REFERENCE_CONFIGS / "clip_bpe_simple_vocab_16e6.txt.gz"
CLIP_MERGES = 49152 - 256 - 2  # merges CLIP's tokenizer reads from its BPE file (the rest are unused)


def reference_config_dir(family: str) -> Path:
    return REFERENCE_CONFIGS / family


def reference_clip_tokenizer(max_length: int = 77):
    """The tokenizer of SD1.5's text encoder (openai/clip-vit-large-patch14), rebuilt from CLIP's BPE file as
    CLIP's own tokenizer does: every byte, every byte ending a word, each merge, then the two special tokens
    (49408 in all). Shipped this way because vocab.json + merges.txt would be 2 MB of package data."""
    import gzip

    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    lines = gzip.decompress(CLIP_BPE_FILE.read_bytes()).decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1:CLIP_MERGES + 1]]  # the first line is a version header
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, model_max_length=max_length)


def check_single_file(file: Path) -> Path:
    file = Path(file)
    if file.suffix != ".safetensors":
        raise ModelError(f"checkpoint {file}: only .safetensors single files are read (got "
                         f"{file.suffix or 'no suffix'}); pickled .ckpt/.pt files can run code when loaded — convert "
                         "it with a trusted tool first")
    if not file.is_file():
        raise ModelError(f"checkpoint {file} does not exist")
    return file


def checkpoint_keys(file: Path) -> list[str]:
    """The tensor names of a safetensors file, from its header only (no weights read)."""
    import struct

    from .weight_headers import header_keys

    try:
        return header_keys(Path(file))
    except ModelError as exc:  # the header is read against the format's grammar, within bounded memory
        reason = str(exc).removeprefix(f"{file}: ")
        raise ModelError(f"cannot read checkpoint {file}: not a readable .safetensors file ({reason})") from None
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ModelError(f"cannot read checkpoint {file}: not a readable .safetensors file ({exc})") from None


def detect_family(file: Path, keys: list[str] | None = None) -> str:
    keys = checkpoint_keys(file) if keys is None else keys
    for family, (first, second) in FAMILY_MARKERS.items():
        if first in keys and any(k.startswith(second) for k in keys):
            return family
    sample = ", ".join(sorted(keys)[:3])
    example, (first, second) = next(iter(FAMILY_MARKERS.items()))
    raise ModelError(f"checkpoint {file}: its keys fit no family this tool reads as a single file (a {example} "
                     f"checkpoint has {first} and {second}*; it holds {len(keys)} keys such as {sample})")


def convert_single_file(file: str | os.PathLike, out: str | os.PathLike, *, family: str,
                        config: str | os.PathLike | None = None) -> Path:
    """Write the diffusers folder of a single-file checkpoint to `out` (atomically; reused when its manifest
    says it was made from these bytes, config and diffusers version)."""
    import diffusers

    file = check_single_file(Path(file))
    found = detect_family(file)
    if found != family:
        raise ModelError(f"checkpoint {file} is an {found} checkpoint, but engines.yaml says family: {family}")
    if not family_info(family).single_file_convert:
        supported = ", ".join(f.value for f, info in FAMILIES.items() if info.single_file_convert)
        raise ModelError(f"checkpoint {file}: single-file {family} checkpoints are not supported yet ({supported} "
                         "is); "
                         "convert it to a diffusers folder with diffusers' from_single_file + save_pretrained")
    config_dir = Path(config) if config is not None else reference_config_dir(family)
    if not (config_dir / "model_index.json").is_file():
        raise ModelError(f"checkpoint {file}: config {config_dir} is not a diffusers folder (no model_index.json)")
    _check_config_folder(config_dir)
    out = Path(out)
    if is_converted(out, file, config_dir):
        return out
    stat = file.stat()
    wanted = {"file": str(file.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "sha256": sha256_file(file), "config": str(config_dir.resolve()), "diffusers": diffusers.__version__}
    from .quiet import quiet_libraries

    quiet_libraries()
    import torch

    try:
        # the shipped reference config has no tokenizer files: its tokenizer is rebuilt from CLIP's BPE file
        tokenizer = {"tokenizer": reference_clip_tokenizer()} if config is None else {}
        pipe = diffusers.StableDiffusionPipeline.from_single_file(
            str(file), config=str(config_dir), local_files_only=True, torch_dtype=torch.float32,
            safety_checker=None, requires_safety_checker=False, **tokenizer)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelError(f"cannot load checkpoint {file} with the {family} config {config_dir}: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None
    with staged_folder(out) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        (tmp / SINGLE_FILE_MANIFEST).write_text(json.dumps(wanted, indent=2))
    return out


def _check_config_folder(config_dir: Path) -> None:
    """The model-folder allow-list for a `config:` folder too: diffusers' from_single_file imports the module
    each model_index.json entry names, so every entry must name a diffusers or transformers class (and every
    component's config.json `_class_name` a plain class name)."""
    from .loading import read_model_index

    index = read_model_index(config_dir)
    for key, entry in index.items():
        if not (isinstance(entry, list) and entry and entry[0] is not None):
            continue
        config = config_dir / key / "config.json"
        if not config.is_file():
            continue
        try:
            class_name = json.loads(config.read_text()).get("_class_name")
        except (OSError, ValueError, AttributeError):
            raise ModelError(f"{config}: not a JSON object of model settings") from None
        if class_name is not None and not (isinstance(class_name, str) and class_name.isidentifier()):
            raise ModelError(f"{config}: _class_name {class_name!r} is not a plain class name")


def is_converted(out: Path, file: Path, config_dir: Path) -> bool:
    """`out` holds the conversion of exactly this file (same path, size and mtime: not re-hashed) and config,
    by this diffusers version. Needs neither torch nor diffusers' import."""
    from importlib.metadata import version

    found, stat = _manifest(Path(out)), Path(file).stat()
    return bool(found) and found.get("file") == str(Path(file).resolve()) and found.get("size") == stat.st_size \
        and found.get("mtime_ns") == stat.st_mtime_ns and found.get("config") == str(Path(config_dir).resolve()) \
        and found.get("diffusers") == version("diffusers") and (Path(out) / "model_index.json").is_file()


def _manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / SINGLE_FILE_MANIFEST).read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------ the inverse mapping (diffusers -> LDM)

_RESNET = [("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("time_emb_proj", "emb_layers.1"),
           ("norm2", "out_layers.0"), ("conv2", "out_layers.3"), ("conv_shortcut", "skip_connection")]
_VAE_RESNET = [("conv_shortcut", "nin_shortcut")]
_VAE_ATTENTION = [("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")]


def _unet_prefixes(config) -> list[tuple[str, str]]:
    """(diffusers module prefix, LDM module prefix) for a UNet2DConditionModel of the SD layout."""
    layers = config.layers_per_block
    blocks = len(config.block_out_channels)
    pairs = [("time_embedding.linear_1.", "time_embed.0."), ("time_embedding.linear_2.", "time_embed.2."),
             ("conv_in.", "input_blocks.0.0."), ("conv_norm_out.", "out.0."), ("conv_out.", "out.2."),
             ("mid_block.resnets.0.", "middle_block.0."), ("mid_block.attentions.0.", "middle_block.1."),
             ("mid_block.resnets.1.", "middle_block.2.")]
    for i in range(blocks):
        for j in range(layers):
            k = (layers + 1) * i + j + 1
            pairs += [(f"down_blocks.{i}.resnets.{j}.", f"input_blocks.{k}.0."),
                      (f"down_blocks.{i}.attentions.{j}.", f"input_blocks.{k}.1.")]
        if i < blocks - 1:
            pairs.append((f"down_blocks.{i}.downsamplers.0.conv.", f"input_blocks.{(layers + 1) * (i + 1)}.0.op."))
        for j in range(layers + 1):
            k = (layers + 1) * i + j
            pairs += [(f"up_blocks.{i}.resnets.{j}.", f"output_blocks.{k}.0."),
                      (f"up_blocks.{i}.attentions.{j}.", f"output_blocks.{k}.1.")]
    return pairs


def _upsampler_prefix(config, name: str, state_keys: set[str]) -> str | None:
    layers = config.layers_per_block
    for i in range(len(config.block_out_channels)):
        head = f"up_blocks.{i}.upsamplers.0.conv."
        if name.startswith(head):
            has_attention = any(k.startswith(f"up_blocks.{i}.attentions.") for k in state_keys)
            return name.replace(head, f"output_blocks.{(layers + 1) * i + layers}.{2 if has_attention else 1}.conv.")
    return None


def _unet_to_ldm(unet) -> dict:
    state = unet.state_dict()
    keys = set(state)
    prefixes = _unet_prefixes(unet.config)
    out = {}
    for name, value in state.items():
        new = _upsampler_prefix(unet.config, name, keys)
        if new is None:
            head = next(((d, o) for d, o in prefixes if name.startswith(d)), None)
            if head is None:
                raise ModelError(f"no original-layout name for the UNet's {name}")
            new = head[1] + name[len(head[0]):]
            if ".resnets." in head[0]:
                new = _rename_last(new, head[1], _RESNET)
        out[UNET_PREFIX + new] = value
    return out


def _rename_last(name: str, prefix: str, table) -> str:
    rest = name[len(prefix):]
    for diffusers_name, ldm_name in table:
        if rest.startswith(diffusers_name + "."):
            return prefix + ldm_name + rest[len(diffusers_name):]
    return name


def _vae_to_ldm(vae) -> dict:
    blocks = len(vae.config.block_out_channels)
    out = {}
    for name, value in vae.state_dict().items():
        new = name
        for part in ("encoder", "decoder"):
            new = new.replace(f"{part}.mid_block.resnets.0.", f"{part}.mid.block_1.")
            new = new.replace(f"{part}.mid_block.resnets.1.", f"{part}.mid.block_2.")
            new = new.replace(f"{part}.conv_norm_out.", f"{part}.norm_out.")
        for i in range(blocks):
            new = new.replace(f"encoder.down_blocks.{i}.resnets.", f"encoder.down.{i}.block.")
            new = new.replace(f"encoder.down_blocks.{i}.downsamplers.0.", f"encoder.down.{i}.downsample.")
            new = new.replace(f"decoder.up_blocks.{i}.resnets.", f"decoder.up.{blocks - 1 - i}.block.")
            new = new.replace(f"decoder.up_blocks.{i}.upsamplers.0.", f"decoder.up.{blocks - 1 - i}.upsample.")
        new = new.replace(".conv_shortcut.", ".nin_shortcut.")
        if ".mid_block.attentions.0." in new:
            head, _, rest = new.partition("mid_block.attentions.0.")
            for diffusers_name, ldm_name in _VAE_ATTENTION:
                if rest.startswith(diffusers_name + "."):
                    rest = ldm_name + rest[len(diffusers_name):]
                    if ldm_name != "norm" and value.ndim == 2:  # LDM's attention uses 1x1 convolutions
                        value = value[:, :, None, None]
                    break
            new = head + "mid.attn_1." + rest
        out[VAE_PREFIX + new] = value
    return out


def _clip_to_ldm(text_encoder) -> dict:
    out = {}
    for name, value in text_encoder.state_dict().items():
        name = name.removeprefix("text_model.")
        out[CLIP_PREFIX + name] = value
    return out


def to_original_layout(pipe) -> dict:
    """The state dict of an SD1.5-layout pipeline in the original single-file layout (keys as A1111 writes)."""
    return {**_unet_to_ldm(pipe.unet), **_vae_to_ldm(pipe.vae), **_clip_to_ldm(pipe.text_encoder)}
