"""The PyTorch reference: the diffusers modules of a model folder behind the same named inputs and
outputs as the exported engines, so one pipeline runs either."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..families import Component, EditKind, Family, family_info
from ..models.loading import load_component, load_controlnet
from ..step_cache import PIECES, StepCache
from ..tensors import TensorSpec
from .engines import RunnerTable
from .runners import TorchRunner


def reference_runners(model_dir: str | Path, family: Family | str, components=None,
                      controlnets: dict[str, Path] | None = None, step_cache: StepCache | None = None) -> RunnerTable:
    """A RunnerTable of torch modules (any size, any batch) for every component of the folder; with `step_cache`,
    the denoiser's step-cache pieces too (over the same module: the reference of a cached pipeline).

    The modules sit behind the same export wrappers the ONNX graphs are traced from, so the reference
    and the engines share one I/O contract.
    """
    from ..components import get_component, load_model_config

    family = Family(family)
    model_dir = Path(model_dir)
    table = RunnerTable()
    options = {"controlnet_residuals": True} if controlnets else {}
    if family_info(family).edit is EditKind.vision_reference and _edit_checkpoint(model_dir):
        options["context_image"] = True  # the encoder takes the image's embeddings, the transformer its latents
    for component in map(Component, components or _present_components(model_dir, family)):
        config = load_model_config(model_dir, family, component)
        module = _with_default_attention(load_component(model_dir, component))
        table.add(component.value, _torch_runner(get_component(family, component), module, config, options,
                                                 f"torch:{component.value}"))
        if step_cache is not None and component.is_denoiser:
            piece_options = {**options, "step_cache": step_cache.engine_option()}
            for piece in PIECES[step_cache.method]:
                table.add(piece, _torch_runner(get_component(family, component, piece), module, config, piece_options,
                                               f"torch:{piece}"))
    for name, folder in (controlnets or {}).items():
        config = load_model_config(model_dir, family, Component.controlnet, controlnet_dir=folder)
        runner = _torch_runner(get_component(family, Component.controlnet), load_controlnet(folder), config, {},
                               f"torch:controlnet:{name}")
        table.add("controlnet", runner, controlnet=name)
    return table


def _with_default_attention(module):
    """Loading forces eager attention on transformers' text encoders (the export needs it: T5 under dynamo);
    diffusers' pipelines load them with transformers' default (SDPA). Eager and SDPA embeddings differ by
    ~1e-6, which moves pixels by a level after a few denoising steps, so the reference takes the default back
    (`set_attn_implementation(None)` resolves it as `from_pretrained` does) and reproduces diffusers bit for bit."""
    if hasattr(module, "set_attn_implementation"):
        module.set_attn_implementation(None)
    return module


def _torch_runner(definition, module, config, options, name: str) -> TorchRunner:
    io = definition.io(config, options)
    wrapper = definition.wrapper(module, config, options)
    inputs = {t.name: TensorSpec(np.dtype(t.dtype), tuple(d if isinstance(d, int) else None for d in t.dims))
              for t in io.inputs}
    return TorchRunner(wrapper, inputs, io.output_names, name=name)


def _edit_checkpoint(model_dir: Path) -> bool:
    from ..models.loading import read_model_index
    from ..workflows import EDIT_PIPELINE_CLASSES

    return read_model_index(model_dir).get("_class_name") in EDIT_PIPELINE_CLASSES


def _present_components(model_dir: Path, family: Family) -> list[Component]:
    """The text-to-image components the folder has (the VAE encoder and ControlNets are asked for)."""
    from ..families import family_info
    from ..models.loading import SUBFOLDER, read_model_index

    index = read_model_index(model_dir)
    return [c for c in family_info(family).components
            if c not in (Component.vae_encoder, Component.controlnet) and index.get(SUBFOLDER[c], [None])[0]]
