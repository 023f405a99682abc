"""Repository generation without built engines or a server: names, the serving contract, TensorRT and
ControlNet configs from hand-made manifests, and the wiring checks. Fast; runs in the default suite."""

from __future__ import annotations

import hashlib

import pytest

from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
from trt_diffusion.errors import ServeError
from trt_diffusion.runtime.loader import BuiltEngine
from trt_diffusion.targets.tensorrt.manifest import EngineManifest, manifest_path
from trt_diffusion.tensors import TensorSpec
from trt_diffusion.triton import configs, contract, naming
from trt_diffusion.triton.configs import EnsembleStep
from trt_diffusion.triton.contract import TensorDecl
from trt_diffusion.triton.repository import PackageOptions, package
from trt_diffusion.triton.validate import _ensemble_problems, read_configs, validate_repository

RANGE = Bucket(Size(64, 64), Size(96, 96), Size(128, 128))
STATIC = Bucket.static(Size(64, 64))


def spec(component: str, bucket: Bucket | None, batch: int = 2, controlnet: str | None = None,
         family: str = "sd15") -> EngineSpec:
    return EngineSpec(model="tiny", family=family, source="/models/tiny", component=component, target="tensorrt",
                      precision="fp16", batch=batch, bucket=bucket, controlnet=controlnet)


def t(name: str, *shape: int, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name=name, dtype=dtype, shape=tuple(shape))


def trt_engine(tmp_path, engine_spec: EngineSpec, inputs, outputs, profile) -> BuiltEngine:
    plan = tmp_path / f"{engine_spec.name}.{engine_spec.key}.plan"
    plan.write_bytes(b"not a real plan")
    manifest = EngineManifest(spec_key=engine_spec.key, spec_name=engine_spec.name, tensorrt_version="10.13.0",
                              compute_capability=(9, 0), device_name="test", flags={}, profile_shapes=profile,
                              onnx_sha256="0" * 64, inputs=tuple(inputs), outputs=tuple(outputs), plan_bytes=15,
                              plan_sha256=hashlib.sha256(b"not a real plan").hexdigest(), build_seconds=0.0)
    manifest.write(manifest_path(plan))
    return BuiltEngine(engine_spec, plan, manifest)


def sd15_trt_engines(tmp_path) -> list[BuiltEngine]:
    """sd15 with a range bucket (dynamic latent dims) and a ControlNet, as TensorRT would build them."""
    def latent(name, batch=2):
        return t(name, batch, 4, -1, -1)

    def profile_latent(batch=2):
        return ((batch, 4, 8, 8), (batch, 4, 12, 12), (batch, 4, 16, 16))

    text = trt_engine(tmp_path, spec("text_encoder", None, batch=1), [t("input_ids", 1, 77, dtype="int64")],
                      [t("hidden_states", 1, 77, 32), t("pooled", 1, 32)], {"input_ids": ((1, 77),) * 3})
    unet_inputs = [latent("sample"), t("timestep", 2), t("encoder_hidden_states", 2, 77, 32),
                   t("mid_block_residual", 2, 64, -1, -1)]
    unet_profile = {"sample": profile_latent(), "timestep": ((2,),) * 3, "encoder_hidden_states": ((2, 77, 32),) * 3,
                    "mid_block_residual": ((2, 64, 2, 2), (2, 64, 3, 3), (2, 64, 4, 4))}
    unet = trt_engine(tmp_path, spec("unet", RANGE), unet_inputs, [latent("noise_pred")], unet_profile)
    cn_inputs = unet_inputs[:3] + [t("controlnet_cond", 2, 3, -1, -1), t("conditioning_scale", 1)]
    cn_profile = {**{k: unet_profile[k] for k in ("sample", "timestep", "encoder_hidden_states")},
                  "controlnet_cond": ((2, 3, 64, 64), (2, 3, 96, 96), (2, 3, 128, 128)),
                  "conditioning_scale": ((1,),) * 3}
    controlnet = trt_engine(tmp_path, spec("controlnet", RANGE, controlnet="canny"), cn_inputs,
                            [t("mid_block_residual", 2, 64, -1, -1)], cn_profile)
    vae = trt_engine(tmp_path, spec("vae_decoder", RANGE, batch=1), [t("latent", 1, 4, -1, -1)],
                     [t("images", 1, 3, -1, -1)], {"latent": profile_latent(1)})
    return [text, unet, controlnet, vae]


# ---------------------------------------------------------------------------- names and contract


def test_names_are_sanitised_and_unique_per_engine():
    assert naming.sanitize("sd 1.5/tiny") == "sd-1-5-tiny"
    assert naming.engine_model_name("sd15.tiny", spec("unet", RANGE)) == "sd15-tiny__unet__64x64-128x128__b2"
    assert naming.engine_model_name("p", spec("controlnet", STATIC, controlnet="canny.v1")) == \
        "p__controlnet__canny-v1__64x64__b2"
    assert naming.engine_model_name("p", spec("text_encoder", None, batch=1)) == "p__text_encoder__any__b1"
    with pytest.raises(ValueError):
        naming.sanitize("...")


def test_contract_stages():
    inputs, outputs = contract.stage_io("full", "sd15", has_controlnets=False)
    assert [i.name for i in inputs] == ["PROMPT", "NEGATIVE_PROMPT", "HEIGHT", "WIDTH", "STEPS", "GUIDANCE_SCALE",
                                        "SEED", "SCHEDULER", "WORKFLOW", "INIT_IMAGE", "MASK", "STRENGTH",
                                        "FRAMES", "GUIDANCE_SCALE_2", "MAX_SEQUENCE_LENGTH", "LORAS", "STEP_CACHE",
                                        "NUM_IMAGES"]
    by_name = {i.name: i for i in inputs}  # the image workflows' inputs: optional, on every entry
    assert all(by_name[n].optional for n in ("WORKFLOW", "INIT_IMAGE", "MASK", "STRENGTH", "FRAMES", "GUIDANCE_SCALE_2",
                                            "LORAS"))
    assert (by_name["INIT_IMAGE"].dims, by_name["MASK"].dims) == ((-1, -1, 3), (-1, -1))
    assert outputs == (contract.IMAGE, contract.TIMING)
    assert contract.stage_io("stream", "sd15", False)[1] == (contract.IMAGE, contract.PREVIEW, contract.STEP,
                                                            contract.TIMING)
    encode_out = [o.name for o in contract.stage_io("encode", "sdxl", True)[1]]
    assert "POSITIVE_POOLED" in encode_out and "USE_NEGATIVE" in encode_out
    assert "POSITIVE_POOLED" not in [o.name for o in contract.stage_io("encode", "sd15", True)[1]]
    denoise_in = [i.name for i in contract.stage_io("denoise", "sd15", True)[0]]
    assert "PROMPT" not in denoise_in and "CONTROL_IMAGE" in denoise_in
    # a video family answers with VIDEO [N, F, H, W, 3] and previews each latent frame; it has no ensemble
    assert contract.stage_io("full", "wan", False)[1] == (contract.VIDEO, contract.TIMING)
    assert contract.stage_io("stream", "wan", False)[1][1] == contract.VIDEO_PREVIEW
    with pytest.raises(ValueError, match="no 'decode' stage"):
        contract.stage_io("decode", "wan", False)
    assert {"WORKFLOW", "INIT_IMAGE", "MASK", "STRENGTH"} <= set(denoise_in)  # the ensemble's denoise starts there
    with pytest.raises(ValueError):
        contract.stage_io("upscale", "sd15", False)


@pytest.mark.parametrize("change,message", [
    ({"engine_backend": "tensorflow"}, "engine_backend must be one of"),
    ({"max_queue_size": 0}, "max_queue_size must be at least 1"),
    ({"queue_timeout_s": 0}, "queue_timeout_s must be positive"),
    ({"warmup_data": "ones"}, "warmup_data must be one of"),
])
def test_bad_options_are_refused(change, message):
    with pytest.raises(ServeError, match=message):
        PackageOptions(**change).check()


# ---------------------------------------------------------------------------- TensorRT + ControlNet


def test_tensorrt_controlnet_repository(tmp_path, tiny_model_factory):
    engines = sd15_trt_engines(tmp_path)
    report = package(engines, tiny_model_factory("sd15"), "sd15", "tiny", tmp_path / "repo",
                     PackageOptions(warmup_data="random"))
    models = read_configs(tmp_path / "repo")
    unet = models["tiny__unet__64x64-128x128__b2"]
    assert unet.platform == "tensorrt_plan" and unet.default_model_filename == "model.plan"
    assert configs.mc.ModelInstanceGroup.Kind.Name(unet.instance_group[0].kind) == "KIND_GPU"
    assert (tmp_path / "repo" / unet.name / "1" / "model.plan").read_bytes() == b"not a real plan"
    # a range bucket is warmed at its min, opt and max shapes
    assert [w.name for w in unet.model_warmup] == ["64x64..128x128 (min)", "64x64..128x128 (opt)",
                                                   "64x64..128x128 (max)"]
    assert [list(w.inputs["sample"].dims) for w in unet.model_warmup] == [[2, 4, 8, 8], [2, 4, 12, 12], [2, 4, 16, 16]]
    assert unet.model_warmup[0].inputs["sample"].random_data
    text = models["tiny__text_encoder__any__b1"]
    assert text.model_warmup[0].inputs["input_ids"].zero_data  # token ids never random
    entry_inputs = {i.name: i for i in models[report.entry].input}
    assert entry_inputs["CONTROL_IMAGE"].optional and list(entry_inputs["CONTROL_IMAGE"].dims) == [-1, -1, 3]
    assert report.controlnets == ["canny"] and report.sizes == ["64x64..128x128"] and report.request_sizes == ["96x96"]
    assert "tiny__controlnet__canny__64x64-128x128__b2" in models
    assert any("tensorrt_plan" in note for note in report.notes)
    validate_repository(tmp_path / "repo")  # also from the manifests copied into the repository


def test_duplicate_engine_names_are_refused(tmp_path, tiny_model_factory):
    engines = sd15_trt_engines(tmp_path)
    with pytest.raises(ServeError, match="same Triton model name"):
        package(engines + engines[1:2], tiny_model_factory("sd15"), "sd15", "tiny", tmp_path / "repo")


def test_dynamic_input_without_profile_is_refused(tmp_path, tiny_model_factory):
    engines = sd15_trt_engines(tmp_path)
    unet = engines[1]
    manifest = unet.manifest.model_copy(update={"profile_shapes": {}})
    engines[1] = BuiltEngine(unet.spec, unet.path, manifest)
    with pytest.raises(ServeError, match="input 'sample' is dynamic"):
        package(engines, tiny_model_factory("sd15"), "sd15", "tiny", tmp_path / "repo")
    assert not (tmp_path / "repo").exists() and not list(tmp_path.glob(".repo.*"))  # nothing half-written


# ---------------------------------------------------------------------------- ensemble wiring


def _model(name, inputs, outputs):
    return configs.pipeline_config(name, stage="encode", inputs=inputs, outputs=outputs, instances=1, queue=None,
                                   parameters={})


def test_ensemble_wiring_problems_are_all_reported():
    a = TensorDecl("A", "TYPE_FP32", (1,))
    b = TensorDecl("B", "TYPE_INT32", (1,))
    opt = TensorDecl("OPT", "TYPE_FP32", (1,), optional=True)
    first = _model("first", [a], [b])
    second = _model("second", [b, TensorDecl("C", "TYPE_FP32", (1,))], [a])
    ensemble = configs.ensemble_config("ens", inputs=[a, opt], outputs=[a, b], parameters={}, steps=[
        EnsembleStep("first", {"A": "OPT"}, {"B": "b", "Z": "z"}),
        EnsembleStep("second", {"B": "A", "X": "x"}, {"A": "A"}),
        EnsembleStep("missing", {}, {}),
    ])
    problems = "\n".join(_ensemble_problems(ensemble, {"first": first, "second": second}))
    assert "step 0 (first): optional tensor 'OPT' feeds required input 'A'" in problems
    assert "step 0 (first): output_map key 'Z' is not an output of first" in problems
    assert "step 1 (second): input 'B' is TYPE_INT32, tensor 'A' is TYPE_FP32" in problems
    assert "step 1 (second): input_map key 'X' is not an input of second" in problems
    assert "step 1 (second): required input 'C' is not mapped" in problems
    assert "step 2 (missing): model_name 'missing' is not in the repository" in problems
    assert "output 'B' is produced by no step" in problems
