"""The LoRAs a repository serves per request (issue 28), as `package` writes them: each refittable engine model holds
its part of every served LoRA under 1/loras/ (sha256 listed), answers LORA_SWITCH_S, and pipeline.json names what a
request may use; `validate_repository` refuses a repository whose parts went missing. Fast: the tiny sd15 engines
of the shared build, no server."""

from __future__ import annotations

import json

import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.targets.lora_switch import LoraParts
from trt_diffusion.triton import stage
from trt_diffusion.triton.description import PipelineDescription
from trt_diffusion.triton.repository import PackageOptions
from trt_diffusion.triton.validate import read_configs, validate_repository
from trt_diffusion.workspace.files import sha256_file


@pytest.fixture(scope="module")
def packaged(built_sd15_two_loras, tmp_path_factory):
    repo = tmp_path_factory.mktemp("lora-package") / "repo"
    report = stage.package_stage(built_sd15_two_loras, repo, "onnxruntime",
                                 options=PackageOptions(lora_cache_sets=3, ensemble=False, stream=False))
    return repo, report


def test_engine_models_hold_their_parts(packaged):
    repo, report = packaged
    assert report.loras == ["detail", "style"]
    (unet,) = [m.name for m in report.models if m.component == "unet"]
    index = json.loads((repo / unet / "1" / "loras" / "loras.json").read_text())
    assert index["component"] == "unet" and sorted(index["loras"]) == ["detail", "style"]
    for entry in [index["base"], *index["loras"].values()]:
        assert sha256_file(repo / unet / "1" / "loras" / entry["file"]) == entry["sha256"]
    parts = LoraParts.read(repo / unet / "1")
    assert parts.names == ("detail", "style") and set(parts.deltas["style"]) <= set(parts.base)
    config = read_configs(repo)[unet]
    assert "LORA_SWITCH_S" in [o.name for o in config.output]
    assert config.parameters["lora_cache_sets"].string_value == "3"
    description = PipelineDescription.read(repo / report.entry / "1")
    assert description.loras == ("detail", "style")
    assert [e.loras for e in description.engines if e.component == "unet"] == [("detail", "style")]
    # the tiny LoRA has no text-encoder part: that engine model takes no LoRA and answers as before
    (text_encoder,) = [m.name for m in report.models if m.component == "text_encoder"]
    assert not (repo / text_encoder / "1" / "loras").exists()
    assert "LORA_SWITCH_S" not in [o.name for o in read_configs(repo)[text_encoder].output]


def test_a_repository_missing_its_parts_is_refused(packaged, tmp_path):
    import shutil

    repo, report = packaged
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    (unet,) = [m.name for m in report.models if m.component == "unet"]
    index = copy / unet / "1" / "loras" / "loras.json"
    listed = json.loads(index.read_text())
    del listed["loras"]["detail"]
    index.write_text(json.dumps(listed))
    with pytest.raises(ServeError, match=r"LoRA\(s\) \['detail'\] are not in its loras/loras.json"):
        validate_repository(copy)
    index.unlink()
    with pytest.raises(ServeError, match="loras.json is missing or unreadable"):
        validate_repository(copy)
