"""Load the torch modules of a diffusers folder: what export, quantization and the reference runner use.

The same code loads a user's real checkpoint and the tiny reference models.
"""

from __future__ import annotations

import importlib
import json
from functools import lru_cache
from pathlib import Path

import torch

from ..errors import ModelError
from ..families import SUBFOLDER, Component  # noqa: F401  (SUBFOLDER re-exported)
from .quiet import quiet_libraries

# The folder of each component inside a diffusers pipeline folder (VAE halves share one).


# model_index.json names a module to import for each entry: only these, never any importable module.
LIBRARIES = ("diffusers", "transformers")
_MODEL_BASES = {"diffusers": ("diffusers", "ModelMixin"), "transformers": ("transformers", "PreTrainedModel")}


def read_model_index(model_dir: Path) -> dict:
    """model_index.json, once every entry is checked to name a diffusers or transformers class."""
    index = Path(model_dir) / "model_index.json"
    try:
        data = json.loads(index.read_text())
    except FileNotFoundError:
        raise ModelError(f"{model_dir} is not a diffusers folder: model_index.json is missing") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{index}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{index}: not a JSON object")
    for key, entry in data.items():
        if isinstance(entry, list) and entry and entry[0] is not None:
            _check_library(index, key, entry)
    return data


def _check_library(index: Path, key: str, entry: list) -> None:
    """[library, class]: diffusers, transformers or one of diffusers' pipeline modules (older model_index.json
    files name `stable_diffusion` for the safety checker), and a plain class name."""
    import importlib.util

    library, class_name = (entry + [None])[:2]
    plain = isinstance(library, str) and library.isidentifier() and isinstance(class_name, str) \
        and class_name.isidentifier()
    if plain and library not in LIBRARIES:
        plain = importlib.util.find_spec(f"diffusers.pipelines.{library}") is not None
    if not plain:
        raise ModelError(f"{index}: {key} names {entry!r}; only diffusers and transformers classes are loaded")


def _class_of(folder: Path, library_and_class: list | None):
    if library_and_class is None:  # a standalone folder (a ControlNet): read its config
        try:
            config = json.loads((folder / "config.json").read_text())
        except FileNotFoundError:
            raise ModelError(f"{folder}: config.json is missing") from None
        library, class_name = "diffusers", config.get("_class_name")
        if class_name is None:
            raise ModelError(f"{folder}/config.json has no _class_name: not a diffusers model folder")
    else:
        library, class_name = (list(library_and_class) + [None])[:2]
    if library not in LIBRARIES or not isinstance(class_name, str) or not class_name.isidentifier():
        raise ModelError(f"{folder}: {library}.{class_name} is not a diffusers or transformers model class")
    try:
        cls = getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError):
        raise ModelError(f"{folder}: class {library}.{class_name} is not available") from None
    base_module, base_name = _MODEL_BASES[library]
    base = getattr(importlib.import_module(base_module), base_name)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ModelError(f"{folder}: {library}.{class_name} is not a {base_module}.{base_name} (a model with weights)")
    return cls


def component_folder(model_dir: Path, component: Component) -> tuple[Path, type]:
    subfolder = SUBFOLDER.get(component)
    if subfolder is None:
        raise ModelError(f"{component.value} is not part of a pipeline folder (ControlNets have their own source)")
    index = read_model_index(model_dir)
    entry = index.get(subfolder)
    if component is Component.image_encoder and not entry and index.get("processor"):
        subfolder, entry = "text_encoder", index.get("text_encoder")  # a vision-language encoder's own tower
    if not entry or entry[0] is None:
        raise ModelError(f"{model_dir} has no {subfolder} (model_index.json lists: "
                         f"{', '.join(k for k, v in index.items() if isinstance(v, list) and v[0])})")
    folder = Path(model_dir) / subfolder
    return folder, _class_of(folder, entry)


def require_safetensors(folder: Path) -> None:
    """Weights are read from .safetensors only: pickled .bin/.ckpt/.pt files can run code when loaded."""
    folder = Path(folder)
    if folder.is_dir() and not any(folder.glob("*.safetensors")):
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".ckpt", ".pt", ".pth", ".pkl"))
        found = f" (it has {', '.join(pickled[:3])})" if pickled else ""
        raise ModelError(f"{folder} holds no .safetensors weights{found}: only safetensors files are read, "
                         "pickled weights can run code when loaded; convert them with save_pretrained(..., "
                         "safe_serialization=True)")


def load_module(folder: Path, cls: type) -> torch.nn.Module:
    """Load weights in fp32 (exports and references are made from fp32 weights), from safetensors only."""
    quiet_libraries()
    require_safetensors(folder)
    try:
        if cls.__module__.startswith("transformers"):
            module = cls.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager",
                                         use_safetensors=True)
        else:
            module = cls.from_pretrained(folder, torch_dtype=torch.float32, use_safetensors=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelError(f"cannot load {folder}: {_first_line(exc)}") from None
    except Exception as exc:  # safetensors raises its own error type for corrupt files
        if "safetensor" in type(exc).__module__.lower() or "header" in str(exc).lower():
            raise ModelError(f"cannot load {folder}: corrupt weights file ({_first_line(exc)})") from None
        raise
    return module.eval()


def load_component(model_dir: Path, component: Component) -> torch.nn.Module:
    folder, cls = component_folder(model_dir, component)
    return load_module(folder, cls)


def load_controlnet(folder: Path) -> torch.nn.Module:
    return load_module(Path(folder), _class_of(Path(folder), None))


@lru_cache(maxsize=64)
def count_parameters(folder: str, library: str, class_name: str, part: str | None = None) -> int:
    """Parameters of a model built from its config on the meta device: no weights are read."""
    cls = getattr(importlib.import_module(library), class_name)
    with torch.device("meta"):
        if library == "transformers":
            config = cls.config_class.from_pretrained(folder)
            module = cls(config)
        else:
            module = cls.from_config(cls.load_config(folder))
    if part == "encoder":
        modules = [module.encoder, getattr(module, "quant_conv", None)]
    elif part == "decoder":
        modules = [module.decoder, getattr(module, "post_quant_conv", None)]
    else:
        modules = [module]
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def parameter_count(model_dir: Path, component: Component, controlnet_dir: Path | None = None) -> int:
    if component is Component.controlnet:
        folder = Path(controlnet_dir)
        cls = _class_of(folder, None)
    else:
        folder, cls = component_folder(model_dir, component)
    part = {"vae_encoder": "encoder", "vae_decoder": "decoder"}.get(component.value)
    library = "transformers" if cls.__module__.startswith("transformers") else "diffusers"
    return count_parameters(str(folder), library, cls.__name__, part)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
