"""Wan LoRA refit (issue 24, acceptance 3): the tiny Wan transformer's LoRAs in diffusers/PEFT naming, in the
original Wan names (`diffusion_model.blocks.0.self_attn.q`, with or without alphas) and in kohya (musubi-tuner)
naming give the weights of diffusers' own `load_lora_weights` + `fuse_lora`, bit-identical to one another; a key
that maps to nothing is refused by name; a refitted onnxruntime or openvino engine equals torch with the LoRA
fused, A -> B -> A and restore leave no residue; Wan 2.2's two experts each take only the part meant for them.

LoRA A is what `models tiny --family wan --lora` writes (self- and cross-attention projections and the
feed-forward of every block, rank 4, alpha = rank); B is made here with another seed, rank 2 and alpha 1 (in
diffusers' adapter metadata, or the kohya files' `.alpha` keys).
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from trt_diffusion.errors import RefitError
from trt_diffusion.families import Component
from trt_diffusion.lora import (
    LoraNaming,
    OnnxRuntimeRefitter,
    build_refit_map,
    externalize_weights,
    lora_deltas,
    pipeline_lora_weights,
    read_lora_file,
)
from trt_diffusion.models.loading import load_component

FUSE_TOLERANCE = 1e-5  # fused weights against diffusers' (the image families' tests/lora/test_deltas.py)
ORT_TOLERANCE = 1e-4  # engine outputs against torch (tests/lora/test_onnxruntime_refit.py)
INPUTS = ("hidden_states", "timestep", "encoder_hidden_states")
B_RANK, B_ALPHA = 2, 1.0
# diffusers' Wan module -> the original Wan module (what the converters map back)
_ORIGINAL = {"attn1": "self_attn", "attn2": "cross_attn", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o",
             "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}
_DIFFUSERS_KEY = re.compile(r"^transformer\.blocks\.(?P<i>\d+)\.(?:(?P<attn>attn[12])\.(?P<proj>to_q|to_k|to_v|to_out\.0)"
                            r"|(?P<ffn>ffn\.net\.0\.proj|ffn\.net\.2))\.lora_(?P<ab>A|B)\.weight$")


def _original_module(key: str) -> tuple[str, str]:
    match = _DIFFUSERS_KEY.match(key)
    assert match, key
    module = (f"{_ORIGINAL[match['attn']]}.{_ORIGINAL[match['proj']]}" if match["attn"] else _ORIGINAL[match["ffn"]])
    return f"blocks.{match['i']}.{module}", match["ab"]


def to_wan_form(state: dict, form: str, alpha: float | None) -> dict:
    """A diffusers-named Wan LoRA as the other trainers write it. `original`: `diffusion_model.` + lora_A/lora_B,
    no alphas (so only for alpha = rank); `comfy`: `diffusion_model.` + lora_down/lora_up + `.alpha`; `musubi`:
    kohya naming, `lora_unet_blocks_0_self_attn_q.lora_down.weight` + `.alpha`."""
    out = {}
    for key, value in state.items():
        module, ab = _original_module(key)
        if form == "original":
            assert alpha is None
            out[f"diffusion_model.{module}.lora_{ab}.weight"] = value
            continue
        stem = f"diffusion_model.{module}" if form == "comfy" else "lora_unet_" + module.replace(".", "_")
        out[f"{stem}.lora_{'down' if ab == 'A' else 'up'}.weight"] = value
        out[f"{stem}.alpha"] = torch.tensor(alpha)
    return out


def fused_with_diffusers(transformer, loras):
    """The reference: what WanPipeline.load_lora_weights does (its lora_state_dict converts the other namings),
    then set_adapters + fuse_lora. `load_into_transformer_2=True` loads the same state into transformer_2."""
    from diffusers import WanPipeline

    fused = copy.deepcopy(transformer)
    names = []
    for index, (path, _) in enumerate(loras):
        state, metadata = WanPipeline.lora_state_dict(str(path), return_lora_metadata=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT: a second adapter joins the first (intended)
            fused.load_lora_adapter(state, metadata=metadata, prefix="transformer", adapter_name=f"l{index}")
        names.append(f"l{index}")
    fused.set_adapters(names, [scale for _, scale in loras])
    fused.fuse_lora(adapter_names=names)
    fused.unload_lora()
    return fused.eval()


def _changed(base, other) -> set[str]:
    theirs = dict(other.named_parameters())
    return {name for name, p in base.named_parameters() if not torch.equal(p, theirs[name])}


def _max_diff(ours: dict, reference) -> float:
    params = dict(reference.named_parameters())
    return max((ours[name] - params[name]).abs().max().item() for name in ours)


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def wan_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("wan", lora=True)


@pytest.fixture(scope="module")
def base(wan_dir):
    return load_component(wan_dir, Component.transformer).eval()


@pytest.fixture(scope="module")
def lora_a(wan_dir) -> Path:
    return wan_dir / "lora" / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def lora_b(base, tmp_path_factory) -> Path:
    from diffusers import WanPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from trt_diffusion.families import family_info

    targets = list(family_info("wan").tiny_lora_targets)  # every linear layer of its attention blocks

    model = copy.deepcopy(base)
    torch.manual_seed(4321)
    config = LoraConfig(r=B_RANK, lora_alpha=B_ALPHA, init_lora_weights=False, target_modules=targets)
    model.add_adapter(config, adapter_name="b")
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(model, adapter_name="b").items()}
    folder = tmp_path_factory.mktemp("wan-lora-b")
    WanPipeline.save_lora_weights(folder, transformer_lora_layers=state, transformer_lora_adapter_metadata=config.to_dict())
    return folder / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def rewrite(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan-rewritten")

    def write(path: Path, transform, name: str) -> Path:
        out = folder / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in transform(load_file(str(path))).items()}, str(out))
        return out

    return write


@pytest.fixture(scope="module")
def other_namings(lora_a, lora_b, rewrite) -> dict[str, Path]:
    """A and B in the other namings: `<form>-a`, `<form>-b`."""
    files = {"original-a": rewrite(lora_a, lambda s: to_wan_form(s, "original", None), "original-a")}
    for form in ("comfy", "musubi"):
        files[f"{form}-a"] = rewrite(lora_a, lambda s, f=form: to_wan_form(s, f, 4.0), f"{form}-a")
        files[f"{form}-b"] = rewrite(lora_b, lambda s, f=form: to_wan_form(s, f, B_ALPHA), f"{form}-b")
    return files


# ---------------------------------------------------------------------------------------------------------------
# The LoRA files and their fused weights
# ---------------------------------------------------------------------------------------------------------------


def test_models_tiny_writes_a_wan_lora_on_every_linear_layer_of_the_blocks(lora_a, base):
    lora = read_lora_file(lora_a)
    assert lora.naming is LoraNaming.diffusers
    modules = {key.rsplit(".lora_", 1)[0] for key in lora.tensors}
    expected = {f"transformer.blocks.{i}.{m}" for i in range(base.config.num_layers)
                for m in [f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")]
                + ["ffn.net.0.proj", "ffn.net.2"]}
    assert modules == expected
    assert len(lora_deltas(base, [(lora_a, 1.0)])) == len(expected)


@pytest.mark.parametrize("chosen", [[("a", 1.0)], [("b", 0.7)], [("a", 0.8), ("b", -0.5)]], ids=["A", "B", "A+B"])
def test_fused_weights_equal_diffusers_load_lora_weights_and_fuse_lora(base, lora_a, lora_b, chosen):
    loras = [({"a": lora_a, "b": lora_b}[name], scale) for name, scale in chosen]
    ours = lora_deltas(base, loras)
    reference = fused_with_diffusers(base, loras)
    assert set(ours) == _changed(base, reference)
    assert _max_diff(ours, reference) <= FUSE_TOLERANCE


@pytest.mark.parametrize("form", ["original", "comfy", "musubi"])
def test_original_and_kohya_namings_give_the_diffusers_named_weights(base, lora_a, lora_b, other_namings, form):
    """Bit for bit: diffusers' converters bake alpha / rank (a power of two here) into the weights exactly."""
    assert read_lora_file(other_namings[f"{form}-a"]).naming is (
        LoraNaming.kohya if form == "musubi" else LoraNaming.wan)
    _assert_identical(lora_deltas(base, [(other_namings[f"{form}-a"], 0.8)]), lora_deltas(base, [(lora_a, 0.8)]))
    if form != "original":  # alpha 1 at rank 2, from `.alpha` keys / from diffusers' adapter metadata
        converted = lora_deltas(base, [(other_namings[f"{form}-b"], -0.6)])
        _assert_identical(converted, lora_deltas(base, [(lora_b, -0.6)]))
        # and diffusers' own loading of the converted file agrees
        reference = fused_with_diffusers(base, [(other_namings[f"{form}-b"], -0.6)])
        assert _max_diff(converted, reference) <= FUSE_TOLERANCE


def _with(extra: dict):
    return lambda state: {**state, **extra}


def _without(pattern: str):
    return lambda state: {k: v for k, v in state.items() if pattern not in k}


@pytest.mark.parametrize(("form", "change", "named", "why"), [
    ("diffusers", _with({"transformer.blocks.0.attn1.to_qq.lora_A.weight": torch.ones(4, 24),
                         "transformer.blocks.0.attn1.to_qq.lora_B.weight": torch.ones(24, 4)}),
     "transformer.blocks.0.attn1.to_qq.lora_A.weight", "has no weight blocks.0.attn1.to_qq.weight"),
    ("comfy", _with({"diffusion_model.blocks.0.norm3.diff": torch.ones(24)}),
     "diffusion_model.blocks.0.norm3.diff", "drops it"),
    ("comfy", _with({"diffusion_model.blocks.1.self_attn.qq.lora_down.weight": torch.ones(4, 24),
                     "diffusion_model.blocks.1.self_attn.qq.lora_up.weight": torch.ones(24, 4)}),
     "diffusion_model.blocks.1.self_attn.qq.lora_down.weight", "refuses the file"),
    ("musubi", _with({"lora_unet_blocks_1_self_attn_qq.lora_down.weight": torch.ones(4, 24),
                      "lora_unet_blocks_1_self_attn_qq.lora_up.weight": torch.ones(24, 4),
                      "lora_unet_blocks_1_self_attn_qq.alpha": torch.tensor(4.0)}),
     "lora_unet_blocks_1_self_attn_qq.lora_down.weight", "refuses the file"),
    ("musubi", _without("ffn_2"), "lora_unet_blocks_0_cross_attn_k.alpha",  # the file's first key
     "needs lora_unet_blocks_0_ffn_2.lora_down.weight, which the file lacks"),
], ids=["diffusers-unknown-module", "original-norm-diff", "original-unknown-module", "kohya-unknown-module",
        "kohya-without-ffn"])
def test_a_key_that_maps_to_nothing_is_refused_by_name(base, lora_a, other_namings, rewrite, form, change, named,
                                                        why):
    source = lora_a if form == "diffusers" else other_namings[f"{form}-a"]
    broken = rewrite(source, change, f"broken-{form}-{abs(hash(named))}")
    with pytest.raises(RefitError, match="does not fit this transformer") as caught:
        lora_deltas(base, [(broken, 1.0)])
    message = str(caught.value)
    assert re.search(rf"\n  (\S+, )?{re.escape(named)}[,:]", message) and why in message, message


# ---------------------------------------------------------------------------------------------------------------
# Wan 2.2's two experts
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def experts(tiny_model_factory):
    folder = tiny_model_factory("wan", variant="two_expert")
    return {c.value: load_component(folder, c).eval() for c in (Component.transformer, Component.transformer_2)}


def test_two_experts_each_take_only_the_part_meant_for_them(experts, lora_a, lora_b, rewrite):
    high, low = experts["transformer"], experts["transformer_2"]
    # as diffusers' load_lora_weights: into the transformer (the high-noise expert) only
    weights = pipeline_lora_weights(experts, [(lora_a, 1.0)], denoiser="transformer")
    assert set(weights) == {"transformer"}
    _assert_identical(weights["transformer"], lora_deltas(high, [(lora_a, 1.0)]))
    # load_into_transformer_2=True: the same file into the low-noise expert only, equal to diffusers' loading there
    into_low = pipeline_lora_weights(experts, [(read_lora_file(lora_a, into_transformer_2=True), 1.0)],
                                     denoiser="transformer")
    assert set(into_low) == {"transformer_2"}
    assert _max_diff(into_low["transformer_2"], fused_with_diffusers(low, [(lora_a, 1.0)])) <= FUSE_TOLERANCE
    # one file for both: `transformer.` keys for the high-noise expert, `transformer_2.` keys for the low-noise one
    pair = rewrite(lora_a, lambda s: {**s, **{k.replace("transformer.", "transformer_2.", 1): v
                                              for k, v in load_file(str(lora_b)).items()}}, "two-experts")
    both = pipeline_lora_weights(experts, [(pair, 0.5)], denoiser="transformer")
    _assert_identical(both["transformer"], lora_deltas(high, [(lora_a, 0.5)]))
    # (lora_b's alpha lives in its metadata, which the rewritten file lacks: alpha = rank there)
    expected_low = lora_deltas(low, [(read_lora_file(rewrite(lora_b, dict, "b-no-metadata"), into_transformer_2=True),
                                      0.5)], component="transformer_2")
    _assert_identical(both["transformer_2"], expected_low)
    with pytest.raises(RefitError, match="has a transformer_2 part of its own"):
        pipeline_lora_weights(experts, [(read_lora_file(pair, into_transformer_2=True), 1.0)], denoiser="transformer")


# ---------------------------------------------------------------------------------------------------------------
# onnxruntime refit of a plain export (default run); the engines of both targets (slow)
# ---------------------------------------------------------------------------------------------------------------


class _Forward(torch.nn.Module):
    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, timestep, encoder_hidden_states):
        return self.transformer(hidden_states=hidden_states, timestep=timestep,
                                encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]


def _inputs(transformer, sequence: int = 16) -> dict[str, np.ndarray]:
    gen = np.random.default_rng(0)
    config = transformer.config
    return {"hidden_states": gen.standard_normal((1, config.in_channels, 2, 4, 4)).astype(np.float32),
            "timestep": np.array([700.0], dtype=np.float32),
            "encoder_hidden_states": gen.standard_normal((1, sequence, config.text_dim)).astype(np.float32)}


def _torch_output(transformer, inputs) -> np.ndarray:
    with torch.no_grad():
        return _Forward(transformer).eval()(*(torch.from_numpy(inputs[n]) for n in INPUTS)).numpy()


@pytest.fixture(scope="module")
def exported(base, tmp_path_factory) -> Path:
    """A dynamo export of the transformer (parameter names kept), every weight in external data."""
    inputs = _inputs(base)
    path = tmp_path_factory.mktemp("wan-onnx") / "transformer.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Forward(base).eval(), tuple(torch.from_numpy(inputs[n]) for n in INPUTS), str(path),
                          dynamo=True, optimize=False, input_names=list(INPUTS), output_names=["noise_pred"])
    return externalize_weights(path, path.parent / "refit-base" / "transformer.onnx")


def test_onnxruntime_refit_equals_torch_fused_and_a_b_a_is_bit_exact(exported, base, lora_a, other_namings):
    refit_map = build_refit_map(exported, base)
    assert not refit_map.unmapped
    refitter = OnnxRuntimeRefitter(exported, refit_map, base)
    inputs = _inputs(base)

    def run(session) -> np.ndarray:
        return session.run(None, inputs)[0]

    base_out = run(refitter.restore_base())
    np.testing.assert_allclose(base_out, _torch_output(base, inputs), rtol=0, atol=ORT_TOLERANCE)
    a = run(refitter.apply([(lora_a, 0.8)]))
    expected = _torch_output(fused_with_diffusers(base, [(lora_a, 0.8)]), inputs)
    np.testing.assert_allclose(a, expected, rtol=0, atol=ORT_TOLERANCE)
    assert np.abs(expected - base_out).max() > 100 * ORT_TOLERANCE  # the LoRA moves it far beyond the tolerance
    b = run(refitter.apply([(other_namings["musubi-b"], 1.0)]))
    assert np.abs(b - a).max() > 100 * ORT_TOLERANCE
    assert np.array_equal(run(refitter.apply([(lora_a, 0.8)])), a)
    assert np.array_equal(run(refitter.apply([(other_namings["musubi-a"], 0.8)])), a)  # kohya: the same refit
    assert np.array_equal(run(refitter.apply([(lora_a, 0.0)])), base_out)
    assert np.array_equal(run(refitter.restore_base()), base_out)


TARGETS = ("onnxruntime", "openvino")


def _built(write_engines_yaml, folder: Path, model_dir: Path, lora: Path, components: list[str], targets) -> Path:
    from trt_diffusion import api

    config = write_engines_yaml(folder, model_dir, "wan", name="w", buckets=["32x32x5"], cfg=["split"],
                                components=components, targets=list(targets),
                                precision={c: "fp32" for c in components},
                                loras={"a": {"source": str(lora), "mode": "refit"}})
    report = api.build(config)
    assert not report.failed, [o.error for o in report.failed]
    return config


@pytest.fixture(scope="module")
def wan_engines(wan_dir, lora_a, tmp_path_factory, write_engines_yaml):
    """engines.yaml of the tiny Wan transformer (32x32x5, fp32, CFG split), a refit LoRA, built on both targets."""
    from trt_diffusion.engines_file import load_engines_file

    return load_engines_file(_built(write_engines_yaml, tmp_path_factory.mktemp("wan-refit"), wan_dir, lora_a,
                                    ["transformer"], TARGETS))


class _Engines:
    """The transformer engines' outputs for one set of feeds, with LoRAs refitted the way a server loads them."""

    def __init__(self, config, model_dir: Path, target: str):
        from trt_diffusion.components import Geometry, get_component, load_model_config
        from trt_diffusion.engines_file import Size
        from trt_diffusion.targets import get_target

        if (reason := get_target(target).unavailable_reason()) is not None:
            pytest.skip(f"{target} is not available here: {reason}")
        self.config, self.target = config, target
        self.definition = get_component("wan", "transformer")
        self.model_config = load_model_config(model_dir, "wan", "transformer")
        self.feeds = self.definition.dummy_inputs(self.model_config, {}, Geometry(1, Size.parse("32x32x5")))

    def output(self, loras=None, component: str = "transformer") -> np.ndarray:
        from trt_diffusion.runtime.loader import engine_runners

        _, _, table = engine_runners(self.config, "w", self.target, loras=loras)
        return table.find(component, size=None, batch=1).run(self.feeds)["noise_pred"]

    def torch(self, transformer) -> np.ndarray:
        wrapper = self.definition.wrapper(transformer, self.model_config, {})
        with torch.inference_mode():
            return wrapper(*[torch.from_numpy(self.feeds[n]) for n in INPUTS]).numpy()


@pytest.mark.slow  # the project's export of the transformer (parity checked), engines on both targets: about 40 s
@pytest.mark.parametrize("target", TARGETS)
def test_refitted_engines_equal_torch_with_the_lora_fused(wan_engines, wan_dir, base, lora_a, lora_b, target):
    engines = _Engines(wan_engines, wan_dir, target)
    base_out = engines.output()
    np.testing.assert_allclose(base_out, engines.torch(base), rtol=0, atol=ORT_TOLERANCE)
    for loras in ([(lora_a, 0.8)], [(lora_a, 0.8), (lora_b, -0.5)]):
        expected = engines.torch(fused_with_diffusers(base, loras))
        np.testing.assert_allclose(engines.output(loras), expected, rtol=0, atol=ORT_TOLERANCE)
        assert np.abs(expected - base_out).max() > 100 * ORT_TOLERANCE  # so the check can fail


@pytest.mark.slow  # shares the engines above
@pytest.mark.parametrize("target", TARGETS)
def test_engine_switch_a_b_a_and_restore_are_bit_exact_whatever_the_naming(wan_engines, wan_dir, lora_a, lora_b,
                                                                          other_namings, target):
    engines = _Engines(wan_engines, wan_dir, target)
    base_out = engines.output()
    first_a = engines.output([(lora_a, 1.0)])
    b = engines.output([(lora_b, 1.0)])
    assert np.abs(b - first_a).max() > 100 * ORT_TOLERANCE
    assert np.array_equal(engines.output([(lora_a, 1.0)]), first_a)
    # the kohya (musubi-tuner) and original-Wan files of A refit the engine exactly as the diffusers-named one
    for form in ("musubi", "comfy", "original"):
        assert np.array_equal(engines.output([(other_namings[f"{form}-a"], 1.0)]), first_a), form
    assert np.array_equal(engines.output([(other_namings["musubi-b"], 1.0)]), b)
    assert np.array_equal(engines.output([(lora_a, 0.0)]), base_out)
    assert np.array_equal(engines.output(), base_out)


@pytest.mark.slow  # the refit command on both targets; shares the engines above
def test_refit_command_takes_a_kohya_wan_lora_and_refuses_what_maps_to_nothing(wan_engines, lora_a, other_namings,
                                                                               rewrite, capsys):
    from trt_diffusion.cli import main

    for target in TARGETS:
        assert main(["refit", str(wan_engines.path), "--model", "w", "--target", target,
                     "--lora", f"{other_namings['musubi-a']}:0.5"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "w.transformer.32x32x5.b1.fp32 │ 20" in out, out  # 2 blocks x (8 attention + 2 ffn) weights
    broken = rewrite(other_namings["comfy-a"], _with({"diffusion_model.blocks.0.modulation.diff": torch.ones(6, 24)}),
                     "modulation-diff")
    assert main(["refit", str(wan_engines.path), "--model", "w", "--lora", str(broken)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "diffusion_model.blocks.0.modulation.diff: diffusers' converter" in err and "drops it" in err, err
    assert "Traceback" not in err
    # a UMT5 part: diffusers' Wan loader loads none, neither does this tool (refused by name, never dropped)
    umt5 = rewrite(lora_a, _with({
        "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": torch.ones(2, 32),
        "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight": torch.ones(32, 2)}), "umt5-part")
    assert main(["refit", str(wan_engines.path), "--model", "w", "--lora", str(umt5)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "its text_encoder part (2 keys): the wan family's text_encoder takes no LoRA weights" in err, err


@pytest.mark.slow  # two transformer exports (the experts), their onnxruntime engines: about 40 s
def test_two_expert_engines_take_the_transformer_part_into_transformer_only(tiny_model_factory, experts, lora_a,
                                                                            lora_b, rewrite, tmp_path_factory,
                                                                            write_engines_yaml):
    from trt_diffusion.engines_file import load_engines_file

    folder = tiny_model_factory("wan", variant="two_expert")
    config = load_engines_file(_built(write_engines_yaml, tmp_path_factory.mktemp("wan22-refit"), folder, lora_a,
                                      ["transformer", "transformer_2"], ["onnxruntime"]))
    engines = _Engines(config, folder, "onnxruntime")
    base_high, base_low = engines.output(), engines.output(component="transformer_2")
    # diffusers' default: the LoRA goes into the high-noise expert; the low-noise one stays at its base exactly
    high = engines.output([(lora_a, 1.0)])
    np.testing.assert_allclose(high, engines.torch(fused_with_diffusers(experts["transformer"], [(lora_a, 1.0)])),
                               rtol=0, atol=ORT_TOLERANCE)
    assert np.abs(high - base_high).max() > 100 * ORT_TOLERANCE
    assert np.array_equal(engines.output([(lora_a, 1.0)], component="transformer_2"), base_low)
    # a `transformer_2.` part refits the low-noise expert (and only it)
    low_only = rewrite(lora_b, lambda s: {k.replace("transformer.", "transformer_2.", 1): v for k, v in s.items()},
                       "low-noise-only")
    low = engines.output([(low_only, 1.0)], component="transformer_2")
    expected = engines.torch(fused_with_diffusers(experts["transformer_2"], [(rewrite(lora_b, dict, "b-plain"), 1.0)]))
    np.testing.assert_allclose(low, expected, rtol=0, atol=ORT_TOLERANCE)
    assert np.array_equal(engines.output([(low_only, 1.0)]), base_high)
