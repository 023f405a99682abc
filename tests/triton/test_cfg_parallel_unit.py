"""`cfg: parallel` in the repository, without engines or a server (issue #24): which engine models get two
instances and where (CPU: two; GPUs: one per device given, two on the one GPU given), and pipeline.json carrying
the CFG modes (a repository packaged before them reads as none recorded). Fast."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from trt_diffusion.triton import configs
from trt_diffusion.triton.description import PipelineDescription
from trt_diffusion.triton.repository import PackageOptions, _instance_group

PARALLEL = ("parallel",)


@pytest.mark.parametrize("component,cfg,expected", [
    ("transformer", PARALLEL, 2), ("transformer_2", PARALLEL, 2), ("unet", ("batched", "parallel"), 2),
    ("controlnet", PARALLEL, 2),  # it runs beside the UNet, once per CFG half
    ("text_encoder", PARALLEL, 1), ("vae_decoder", PARALLEL, 1),
    ("transformer", ("split",), 1), ("transformer", (), 1),
])
def test_cpu_engine_models_of_a_parallel_model(component, cfg, expected):
    spec = SimpleNamespace(component=component)
    assert _instance_group(spec, "KIND_CPU", PackageOptions(), cfg) == (expected, ())
    # --engine-instances above two is kept; CPU instances never name GPUs
    assert _instance_group(spec, "KIND_CPU", PackageOptions(engine_instances=3, gpus=(0, 1)), cfg) == (3, ())


@pytest.mark.parametrize("gpus,expected", [
    ((0, 1), (1, (0, 1))),  # one instance on each GPU: each CFG half on its own device
    ((2, 3, 5), (1, (2, 3, 5))),
    ((), (1, ())),  # every GPU Triton sees, one each (a one-GPU host: the halves take turns)
    ((1,), (2, (1,))),  # the one GPU given holds both
])
def test_gpu_engine_models_of_a_parallel_model(gpus, expected):
    transformer = SimpleNamespace(component="transformer")
    assert _instance_group(transformer, "KIND_GPU", PackageOptions(gpus=gpus), PARALLEL) == expected
    text = SimpleNamespace(component="text_encoder")
    assert _instance_group(text, "KIND_GPU", PackageOptions(gpus=gpus), PARALLEL) == (1, gpus)


def test_the_instance_group_as_triton_reads_it():
    config = configs.engine_config("m", inputs=[], outputs=[], backend="tensorrt_plan", model_file="model.plan",
                                   instances=1, kind="KIND_GPU", warmup=[], random_warmup=False, parameters={},
                                   gpus=(0, 1))
    parsed = configs.parse(configs.to_text(config), "m")
    (group,) = parsed.instance_group
    assert (group.count, list(group.gpus), configs.mc.ModelInstanceGroup.Kind.Name(group.kind)) == (
        1, [0, 1], "KIND_GPU")


def test_pipeline_json_carries_the_cfg_modes(tmp_path):
    described = PipelineDescription("wan", "wan", (), workflows=("txt2img",), cfg=("batched", "parallel"))
    described.write(tmp_path)
    assert PipelineDescription.read(tmp_path).cfg == ("batched", "parallel")
    raw = json.loads((tmp_path / "pipeline.json").read_text())
    del raw["cfg"]  # packaged before cfg was recorded: the mode follows the engines, as it did
    (tmp_path / "pipeline.json").write_text(json.dumps(raw))
    assert PipelineDescription.read(tmp_path).cfg == ()
