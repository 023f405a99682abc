"""LoRA refit on Z-Image's transformer (issue #42, acceptance 4), through the generic paths the DiT families use
(tests/lora/test_dit_family_loras.py): diffusers/PEFT-named LoRAs (ZImageLoraLoaderMixin loads the transformer
only) fuse to diffusers' own load_lora_adapter + fuse_lora, and a refittable onnxruntime transformer engine refitted
with a LoRA equals torch with it fused; A -> B -> A and the base restore are bit-exact.

LoRA A is what `models tiny --lora` writes (the attention projections, rank 4), declared for refit in the session's
`built_z_image` (conftest.py); B is made here with another seed, rank 2, alpha 1 and a feed-forward layer too. Slow:
it refits the batch-2 onnxruntime transformer engine of that shared build (no export or build of its own)."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from trt_diffusion.engines_file import Size
from trt_diffusion.families import Component
from trt_diffusion.lora import lora_deltas
from trt_diffusion.models.loading import load_component

from .conftest import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOLERANCE = 1e-4  # engine outputs against torch (tests/lora/test_onnxruntime_refit.py)
EFFECT = 20 * TOLERANCE  # what a LoRA must move the output by for the equality checks to mean something


def fused_with_diffusers(transformer, loras) -> torch.nn.Module:
    from diffusers import ZImagePipeline

    fused = copy.deepcopy(transformer)
    names = []
    for index, (path, _) in enumerate(loras):
        state, metadata = ZImagePipeline.lora_state_dict(str(path), return_lora_metadata=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fused.load_lora_adapter(state, metadata=metadata, prefix="transformer", adapter_name=f"lora{index}")
        names.append(f"lora{index}")
    fused.set_adapters(names, [scale for _, scale in loras])
    fused.fuse_lora(adapter_names=names)
    fused.unload_lora()
    return fused.eval()


@pytest.fixture(scope="module")
def setup(built_z_image, tmp_path_factory):
    from diffusers import ZImagePipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from trt_diffusion.engines_file import load_engines_file

    path, _ = built_z_image
    config = load_engines_file(path)
    folder = config.models[MODEL].source.path
    base = load_component(folder, Component.transformer)
    module = copy.deepcopy(base)
    torch.manual_seed(4321)
    lora_config = LoraConfig(r=2, lora_alpha=1, init_lora_weights=False, target_modules=["to_k", "feed_forward.w2"])
    module.add_adapter(lora_config, adapter_name="b")
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(module, adapter_name="b").items()}
    b_dir = tmp_path_factory.mktemp("z_image-lora-b")
    ZImagePipeline.save_lora_weights(b_dir, transformer_lora_layers=state,
                                     transformer_lora_adapter_metadata=lora_config.to_dict())
    return dict(folder=folder, base=base, a=config.models[MODEL].loras["a"].path,
                b=b_dir / "pytorch_lora_weights.safetensors", config=config)


class _Engine:
    """The transformer engine's output for one set of feeds (two rows of different prompt lengths: the batch-2 engine
    CFG batched runs), with LoRAs refitted the way a server loads them."""

    def __init__(self, setup: dict):
        from trt_diffusion.components import Geometry, get_component, load_model_config

        self.setup = setup
        self.definition = get_component("z_image", "transformer")
        self.model_config = load_model_config(setup["folder"], "z_image", "transformer")
        self.feeds = self.definition.dummy_inputs(self.model_config, {}, Geometry(2, Size(64, 64), text=40))

    def output(self, loras=None) -> np.ndarray:
        from trt_diffusion.runtime.loader import engine_runners

        _, _, table = engine_runners(self.setup["config"], MODEL, "onnxruntime", loras=loras)
        return table.find("transformer", size=Size(64, 64), batch=2).run(self.feeds)["noise_pred"]

    def torch(self, transformer) -> np.ndarray:
        wrapper = self.definition.wrapper(transformer, self.model_config, {})
        names = self.definition.io(self.model_config, {}).input_names
        with torch.inference_mode():
            return wrapper(*[torch.from_numpy(self.feeds[n]) for n in names]).numpy()


def test_fused_weights_equal_diffusers_fuse_lora(setup):
    loras = [(setup["a"], 0.8), (setup["b"], -0.5)]
    deltas = lora_deltas(setup["base"], loras, component="transformer")
    fused = dict(fused_with_diffusers(setup["base"], loras).state_dict())
    assert deltas, "the LoRAs changed nothing"
    for name, weight in deltas.items():
        np.testing.assert_allclose(weight.numpy(), fused[name].numpy(), rtol=0, atol=1e-5)


def test_refitted_engine_equals_torch_fused_and_a_b_a_is_bit_exact(setup):
    engine = _Engine(setup)
    base_out = engine.output()
    np.testing.assert_allclose(base_out, engine.torch(setup["base"]), rtol=0, atol=TOLERANCE)
    a = engine.output([(setup["a"], 0.8)])
    expected = engine.torch(fused_with_diffusers(setup["base"], [(setup["a"], 0.8)]))
    np.testing.assert_allclose(a, expected, rtol=0, atol=TOLERANCE)
    assert np.abs(expected - base_out).max() > EFFECT  # so the check can fail
    b = engine.output([(setup["b"], 1.0)])
    assert np.abs(b - a).max() > EFFECT
    np.testing.assert_allclose(b, engine.torch(fused_with_diffusers(setup["base"], [(setup["b"], 1.0)])),
                               rtol=0, atol=TOLERANCE)
    assert np.array_equal(engine.output([(setup["a"], 0.8)]), a)
    assert np.array_equal(engine.output([(setup["a"], 0.0)]), base_out)
    assert np.array_equal(engine.output(), base_out)
