"""LoRA refit on the 2026 DiT families (issue #26, acceptance 2): Qwen-Image, FLUX.2 dev and FLUX.2 Klein
transformers take diffusers/PEFT-named LoRAs (what their LoRA loaders load: the transformer only). The fused weights
equal diffusers' own load_lora_adapter + fuse_lora; a refittable onnxruntime transformer engine refitted with a LoRA
equals torch with it fused, and A -> B -> A and the base restore are bit-exact. `qwen_image_edit` is Qwen-Image-Edit's
transformer engine (the same weights' names; its graph takes the reference image's tokens too).

LoRA A is what `models tiny --lora` writes (the attention projections, rank 4); B is made here with another seed,
rank 2, alpha 1 and also the feed-forward layers. Slow: one transformer export and engine per family (about 40 s)."""

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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FAMILIES = ("qwen_image", "qwen_image_edit", "flux2", "flux2_klein")
# a case -> (family, tiny variant): the edit checkpoint is a qwen_image one
CASES = {"qwen_image_edit": ("qwen_image", "edit")}
TOLERANCE = 1e-4  # engine outputs against torch (tests/lora/test_onnxruntime_refit.py)
# what a LoRA must move the output by for the equality checks to mean something (the tiny FLUX.2's one double
# block carries A's projections: about 0.008 at scale 0.8, 80x the tolerance)
EFFECT = 20 * TOLERANCE
B_TARGETS = {"qwen_image": ["to_q", "to_v", "img_mlp.net.2"], "qwen_image_edit": ["to_q", "to_v", "img_mlp.net.2"],
             "flux2": ["to_k", "ff.linear_out"],
             "flux2_klein": ["to_k", "ff.linear_out"]}


def _pipeline_class(family: str):
    import diffusers

    return {"qwen_image": diffusers.QwenImagePipeline, "qwen_image_edit": diffusers.QwenImageEditPipeline,
            "flux2": diffusers.Flux2Pipeline,
            "flux2_klein": diffusers.Flux2KleinPipeline}[family]


def fused_with_diffusers(family: str, transformer, loras) -> torch.nn.Module:
    """The reference: each LoRA loaded as its pipeline's loader reads it, scales set, fused, unloaded."""
    fused = copy.deepcopy(transformer)
    names = []
    for index, (path, _) in enumerate(loras):
        state, metadata = _pipeline_class(family).lora_state_dict(str(path), return_lora_metadata=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fused.load_lora_adapter(state, metadata=metadata, prefix="transformer", adapter_name=f"lora{index}")
        names.append(f"lora{index}")
    fused.set_adapters(names, [scale for _, scale in loras])
    fused.fuse_lora(adapter_names=names)
    fused.unload_lora()
    return fused.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def setup(family, tiny_model_factory, tmp_path_factory, write_engines_yaml):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from trt_diffusion import api
    from trt_diffusion.engines_file import expand, load_engines_file

    family_name, variant = CASES.get(family, (family, None))
    folder = tiny_model_factory(family_name, lora=True, variant=variant)
    base = load_component(folder, Component.transformer)
    lora_a = folder / "lora" / "pytorch_lora_weights.safetensors"
    # B: another seed, rank 2, alpha 1, the feed-forward too
    module = copy.deepcopy(base)
    torch.manual_seed(4321)
    config = LoraConfig(r=2, lora_alpha=1, init_lora_weights=False, target_modules=B_TARGETS[family])
    module.add_adapter(config, adapter_name="b")
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(module, adapter_name="b").items()}
    b_dir = tmp_path_factory.mktemp(f"{family}-lora-b")
    _pipeline_class(family).save_lora_weights(b_dir, transformer_lora_layers=state,
                                              transformer_lora_adapter_metadata=config.to_dict())
    lora_b = b_dir / "pytorch_lora_weights.safetensors"
    root = tmp_path_factory.mktemp(f"{family}-refit")
    cfg = ["split"] if family != "flux2" else ["none"]
    # an edit model's workflow needs its reference encoders listed beside the transformer (built, not used here)
    components = ["transformer"] + (["image_encoder", "vae_encoder"] if variant == "edit" else [])
    path = write_engines_yaml(root, folder, family_name, name="m", components=components, cfg=cfg,
                              precision={"transformer": "fp32"}, loras={"a": {"source": str(lora_a), "mode": "refit"}})
    report = api.build(path, target="onnxruntime")
    assert not report.failed, [o.error for o in report.failed]
    config = load_engines_file(path)
    options = next(dict(s.build_options) for s in expand(config) if s.component is Component.transformer)
    return dict(folder=folder, base=base, a=lora_a, b=lora_b, config=config, family=family_name, options=options)


class _Engine:
    """The transformer engine's output for one set of feeds, with LoRAs refitted the way a server loads them."""

    def __init__(self, family: str, setup: dict):
        from trt_diffusion.components import Geometry, get_component, load_model_config

        self.setup, family = setup, setup["family"]
        self.options = {k: v for k, v in setup["options"].items() if k.startswith("context_")}  # edit: its reference
        self.definition = get_component(family, "transformer")
        self.model_config = load_model_config(setup["folder"], family, "transformer")
        self.feeds = self.definition.dummy_inputs(self.model_config, self.options, Geometry(1, Size(64, 64)))

    def output(self, loras=None) -> np.ndarray:
        from trt_diffusion.runtime.loader import engine_runners

        _, _, table = engine_runners(self.setup["config"], "m", "onnxruntime", loras=loras)
        return table.find("transformer", size=Size(64, 64), batch=1).run(self.feeds)["noise_pred"]

    def torch(self, transformer) -> np.ndarray:
        wrapper = self.definition.wrapper(transformer, self.model_config, self.options)
        names = self.definition.io(self.model_config, self.options).input_names
        with torch.inference_mode(), self.definition.export_context():
            return wrapper(*[torch.from_numpy(self.feeds[n]) for n in names]).numpy()


def test_fused_weights_equal_diffusers_fuse_lora(family, setup):
    base = setup["base"]
    loras = [(setup["a"], 0.8), (setup["b"], -0.5)]
    deltas = lora_deltas(base, loras, component="transformer")
    fused = dict(fused_with_diffusers(family, base, loras).state_dict())
    assert deltas, "the LoRAs changed nothing"
    for name, weight in deltas.items():
        np.testing.assert_allclose(weight.numpy(), fused[name].numpy(), rtol=0, atol=1e-5)


def test_refitted_engine_equals_torch_fused_and_a_b_a_is_bit_exact(family, setup):
    engine = _Engine(family, setup)
    base_out = engine.output()
    np.testing.assert_allclose(base_out, engine.torch(setup["base"]), rtol=0, atol=TOLERANCE)
    a = engine.output([(setup["a"], 0.8)])
    expected = engine.torch(fused_with_diffusers(family, setup["base"], [(setup["a"], 0.8)]))
    np.testing.assert_allclose(a, expected, rtol=0, atol=TOLERANCE)
    assert np.abs(expected - base_out).max() > EFFECT  # so the check can fail
    b = engine.output([(setup["b"], 1.0)])
    assert np.abs(b - a).max() > EFFECT
    np.testing.assert_allclose(b, engine.torch(fused_with_diffusers(family, setup["base"], [(setup["b"], 1.0)])),
                               rtol=0, atol=TOLERANCE)
    assert np.array_equal(engine.output([(setup["a"], 0.8)]), a)
    assert np.array_equal(engine.output([(setup["a"], 0.0)]), base_out)
    assert np.array_equal(engine.output(), base_out)
