"""LoRA fixtures: the tiny sd15 UNet, LoRA files in several namings, ONNX exports of the UNet.

LoRA A is the one `write_tiny_model(lora=True)` writes (attention projections, rank 4, alpha = rank).
LoRA B is made here with another seed on other modules, including 1x1 and 3x3 convolutions, and an
alpha that is not its rank (saved in diffusers' adapter metadata), so it exercises what A does not.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from trt_diffusion.families import Component
from trt_diffusion.lora import externalize_weights
from trt_diffusion.models.loading import load_component

SEQUENCE = 77  # text tokens: the project's UNet export fixes the CLIP sequence length
ENGINES_YAML = """\
version: 1
build: {{workspace: build, opset: 20}}
defaults: {{targets: [onnxruntime], cfg: batched, batch: [1]}}
models:
  tiny:
    source: {source}
    family: sd15
    components: [unet]
    buckets: ["64x64"]
    precision: {{unet: fp32}}
"""
LORA_B_TARGETS = ["to_v", "ff.net.2", "conv1", "proj_in"]


class UNetForExport(torch.nn.Module):
    """Positional inputs, one output; holds the UNet as `self.unet` so initializer names get a `unet.` prefix."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]


def unet_inputs(unet: torch.nn.Module, seed: int = 0) -> dict[str, np.ndarray]:
    gen = np.random.default_rng(seed)
    return {
        "sample": gen.standard_normal((2, unet.config.in_channels, 8, 8)).astype(np.float32),
        "timestep": np.array([10.0, 500.0], dtype=np.float32),
        "encoder_hidden_states": gen.standard_normal((2, SEQUENCE, unet.config.cross_attention_dim)).astype(np.float32),
    }


def torch_output(unet: torch.nn.Module, inputs: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        args = [torch.from_numpy(inputs[name]) for name in ("sample", "timestep", "encoder_hidden_states")]
        return UNetForExport(unet).eval()(*args).numpy()


def export_unet(unet: torch.nn.Module, path: Path, *, dynamo: bool, optimize: bool = False) -> Path:
    inputs = unet_inputs(unet)
    args = tuple(torch.from_numpy(inputs[name]) for name in ("sample", "timestep", "encoder_hidden_states"))
    kwargs = {"optimize": optimize} if dynamo else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy tracer's TracerWarnings about diffusers' shape checks
        torch.onnx.export(UNetForExport(unet).eval(), args, str(path), dynamo=dynamo, input_names=list(inputs),
                          output_names=["out_sample"], **kwargs)
    return path


def fused_with_diffusers(unet: torch.nn.Module, loras: Sequence[tuple[Path, float]]) -> torch.nn.Module:
    """The reference: diffusers/PEFT load each LoRA as an adapter, set the scales, fuse, unload.

    Loaded as `pipe.load_lora_weights` does (kohya conversion, alphas and adapter metadata included);
    `unet.load_lora_adapter(path)` alone skips the metadata unless `use_safetensors=True`.
    """
    from diffusers import StableDiffusionPipeline

    fused = copy.deepcopy(unet)
    names = []
    for index, (path, _) in enumerate(loras):
        state, alphas, metadata = StableDiffusionPipeline.lora_state_dict(str(path), return_lora_metadata=True,
                                                                          unet_config=unet.config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT warns that a second adapter joins the first: intended
            fused.load_lora_adapter(state, network_alphas=alphas, metadata=metadata, prefix="unet",
                                    adapter_name=f"lora{index}")
        names.append(f"lora{index}")
    fused.set_adapters(names, [scale for _, scale in loras])
    fused.fuse_lora(adapter_names=names)
    fused.unload_lora()
    return fused.eval()


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """The functions above, for test modules (importlib import mode: tests cannot import conftest)."""
    return SimpleNamespace(unet_inputs=unet_inputs, torch_output=torch_output, export_unet=export_unet,
                           fused_with_diffusers=fused_with_diffusers, to_kohya=to_kohya,
                           to_processor_naming=to_processor_naming)


@pytest.fixture(scope="session")
def sd15_dir(tiny_sd15_dir) -> Path:
    return tiny_sd15_dir


@pytest.fixture(scope="session")
def base_unet(sd15_dir) -> torch.nn.Module:
    return load_component(sd15_dir, Component.unet)


@pytest.fixture(scope="session")
def lora_a(sd15_dir) -> Path:
    return sd15_dir / "lora" / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="session")
def lora_b(base_unet, tmp_path_factory) -> Path:
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    unet = copy.deepcopy(base_unet)
    torch.manual_seed(1234)
    config = LoraConfig(r=2, lora_alpha=3, init_lora_weights=False, target_modules=LORA_B_TARGETS)
    unet.add_adapter(config, adapter_name="b")
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(unet, adapter_name="b").items()}
    folder = tmp_path_factory.mktemp("lora-b")
    StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=state,
                                              unet_lora_adapter_metadata=config.to_dict())
    return folder / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="session")
def rewrite_lora(tmp_path_factory) -> Callable[..., Path]:
    """`rewrite_lora(path, transform, name)`: a copy of a LoRA file whose state dict went through `transform`."""
    folder = tmp_path_factory.mktemp("rewritten-loras")

    def rewrite(path: Path, transform: Callable[[dict], dict], name: str) -> Path:
        out = folder / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in transform(load_file(str(path))).items()}, str(out))
        return out

    return rewrite


def to_kohya(state: dict) -> dict:
    """diffusers' own PEFT -> kohya converter (alpha = rank)."""
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya

    return convert_state_dict_to_kohya(state)


_PROCESSOR_FORM = re.compile(r"^(?P<head>.*\.attn\d)\.(?P<proj>to_q|to_k|to_v|to_out\.0)\.lora_(?P<ab>A|B)\.weight$")


def to_processor_naming(state: dict) -> dict:
    """The old attention-processor form: `attn1.processor.to_q_lora.down.weight`."""
    out = {}
    for key, value in state.items():
        match = _PROCESSOR_FORM.match(key)
        proj = {"to_out.0": "to_out"}.get(match["proj"], match["proj"])
        out[f"{match['head']}.processor.{proj}_lora.{'down' if match['ab'] == 'A' else 'up'}.weight"] = value
    return out


@pytest.fixture(scope="session")
def dynamo_export(sd15_dir, tmp_path_factory) -> Path:
    """The project's own export of the UNet (`api.export`: dynamo, optimize=False, graph passes, parity
    checked). Parameter names kept without prefix; weights under 1 KiB stay inside the .onnx file."""
    from trt_diffusion import api

    folder = tmp_path_factory.mktemp("onnx-export")
    config = folder / "engines.yaml"
    config.write_text(ENGINES_YAML.format(source=sd15_dir))
    report = api.export(config)
    (result,) = report.results
    return result.artifact.path / result.artifact.manifest["onnx"]


@pytest.fixture(scope="session")
def dynamo_onnx(dynamo_export) -> Path:
    """The refit base: the project's export with every weight in external data."""
    return externalize_weights(dynamo_export, dynamo_export.parent / "refit-base" / "unet.onnx")


@pytest.fixture(scope="session")
def legacy_onnx(base_unet, tmp_path_factory) -> Path:
    """A legacy (TorchScript) export, weights external: Linear weights are transposed `onnx::MatMul_N`."""
    exported = export_unet(base_unet, tmp_path_factory.mktemp("onnx-legacy") / "unet.onnx", dynamo=False)
    return externalize_weights(exported, exported.parent / "refit-base" / "unet.onnx")
