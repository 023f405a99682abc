"""The image workflows' part of the entry contract without a server (issue 25): WORKFLOW, INIT_IMAGE, MASK and
STRENGTH as the backend reads them, what package records and refuses, old repositories, the client's caps.
Served end to end in test_image_workflows_serving.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from trt_diffusion.errors import RuntimeInputError, ServeError
from trt_diffusion.families import Family
from trt_diffusion.runtime.engines import RunnerTable
from trt_diffusion.runtime.pipeline import EnginePipeline
from trt_diffusion.triton import client, repository
from trt_diffusion.triton.backend import pb, requests
from trt_diffusion.triton.client import ImageRequest
from trt_diffusion.triton.description import PipelineDescription

IMAGE = np.zeros((64, 64, 3), np.uint8)
MASK = np.full((64, 64), 255, np.uint8)


@pytest.fixture
def read(monkeypatch):
    monkeypatch.setattr(pb, "input_array", lambda tensors, name: tensors.get(name))
    return lambda image_request: requests.read_request(image_request.tensors())


def test_the_inputs_are_read_as_sent(read):
    generation = read(ImageRequest("a fox", 64, 64, workflow="inpaint", init_image=IMAGE + 7, mask=MASK,
                                   strength=0.7))
    assert (generation.workflow, generation.strength) == ("inpaint", 0.7)  # the decimal sent, not 0.699999988
    assert generation.init_image.shape == (64, 64, 3) and generation.init_image[0, 0, 0] == 7
    assert generation.mask.shape == (64, 64) and generation.mask.dtype == np.uint8
    plain = read(ImageRequest("a fox", 64, 64))
    assert (plain.workflow, plain.init_image, plain.mask, plain.strength) == (None, None, None, None)
    assert plain.resolved_workflow == "txt2img" and read(ImageRequest("a", 64, 64, init_image=IMAGE)
                                                         ).resolved_workflow == "img2img"


def test_an_image_tensor_holds_one_image(read):
    tensors = ImageRequest("a fox", 64, 64, init_image=IMAGE).tensors()
    tensors["INIT_IMAGE"] = np.zeros((2, 64, 64, 3), np.uint8)
    with pytest.raises(RuntimeInputError, match=r"INIT_IMAGE must hold one image, got shape \[2, 64, 64, 3\]"):
        requests.read_request(tensors)
    tensors = ImageRequest("a fox", 64, 64, workflow="x" * 1000).tensors()
    with pytest.raises(RuntimeInputError, match="WORKFLOW has 1000 bytes"):
        requests.read_request(tensors)


@pytest.fixture(scope="module")
def img2img_only(tiny_sd15_dir) -> EnginePipeline:
    """A routing table (no engines behind it: validation runs none) serving txt2img and img2img, no inpaint."""
    table = RunnerTable()
    for component in ("text_encoder", "unet", "vae_decoder", "vae_encoder"):
        table.add(component, None)
    return EnginePipeline(tiny_sd15_dir, "sd15", table, workflows=("txt2img", "img2img"))


def test_a_mask_to_a_model_without_inpaint_is_refused_by_name(img2img_only, read):
    img2img_only.validate(read(ImageRequest("a fox", 64, 64, init_image=IMAGE)))
    with pytest.raises(RuntimeInputError, match=r"WORKFLOW inpaint \(a MASK asks for inpaint\) is not served: it "
                                                 r"is not in this model's workflows \(served: txt2img, img2img\)"):
        img2img_only.validate(read(ImageRequest("a fox", 64, 64, init_image=IMAGE, mask=MASK)))


def test_requests_of_other_workflows_or_strengths_never_share_a_batch(img2img_only, read):
    keys = {img2img_only.batch_key(read(r)) for r in (
        ImageRequest("a", 64, 64), ImageRequest("b", 64, 64, init_image=IMAGE),
        ImageRequest("c", 64, 64, init_image=IMAGE, strength=0.5))}
    assert len(keys) == 3
    same = {img2img_only.batch_key(read(ImageRequest(p, 64, 64, init_image=IMAGE, seed=s)))
            for p, s in (("a", 1), ("b", 2))}
    assert len(same) == 1  # prompts and seeds are each request's own


def _built(*components: str) -> list:
    return [SimpleNamespace(spec=SimpleNamespace(component=c)) for c in components]


def test_package_refuses_workflows_it_cannot_serve():
    base = _built("text_encoder", "unet", "vae_decoder")
    assert repository._check_workflows(base, Family.sd15, None) == ("txt2img",)
    assert repository._check_workflows(base + _built("vae_encoder"), Family.sd15, ["txt2img", "inpaint"]) == (
        "txt2img", "inpaint")
    with pytest.raises(ServeError, match="img2img encode the INIT_IMAGE: the engine list has no vae_encoder engine"):
        repository._check_workflows(base, Family.sd15, ["txt2img", "img2img"])
    with pytest.raises(ServeError, match=r"the sd15 family has no edit workflow \(families that have it: flux, qwen_image\)"):
        repository._check_workflows(base + _built("vae_encoder"), Family.sd15, ["edit"])
    with pytest.raises(ServeError, match="unknown workflow"):
        repository._check_workflows(base, Family.sd15, ["outpaint"])


def test_a_repository_packaged_before_workflows_serves_txt2img(tmp_path):
    description = PipelineDescription("p", "sd15", (), workflows=("txt2img", "img2img"))
    description.write(tmp_path)
    assert PipelineDescription.read(tmp_path).workflows == ("txt2img", "img2img")
    raw = json.loads((tmp_path / "pipeline.json").read_text())
    del raw["workflows"]
    (tmp_path / "pipeline.json").write_text(json.dumps(raw))
    assert PipelineDescription.read(tmp_path).workflows == ("txt2img",)


def test_an_old_server_is_told_apart_from_a_bad_request():
    class Refusal(Exception):
        def message(self):
            return "[request id: <id_unknown>] unexpected inference input 'INIT_IMAGE' for model 'p'"

    err = client.server_error(Refusal(), "127.0.0.1:8000", "p")
    assert "packaged before image-conditioned workflows" in str(err) and "package it again" in str(err)


@pytest.mark.parametrize("change,message", [
    (dict(init_image=IMAGE.astype(np.float32)), "INIT_IMAGE must be uint8 .* got float32"),
    (dict(init_image=IMAGE[..., 0]), r"INIT_IMAGE must be \[H, W, 3\], got \[64, 64\]"),
    (dict(init_image=IMAGE, mask=IMAGE), r"MASK must be \[H, W\], got \[64, 64, 3\]"),
    (dict(init_image=np.zeros((1, 9000, 3), np.uint8)), "INIT_IMAGE is 9000x1: each side must be 1 to 8192"),
    (dict(init_image=np.zeros((0, 64, 3), np.uint8)), "each side must be 1 to 8192"),
    (dict(init_image=IMAGE.tolist()), "INIT_IMAGE must be a numpy uint8 array"),
])
def test_the_client_checks_its_image_tensors_before_sending(change, message):
    with pytest.raises(ServeError, match=message):
        ImageRequest("a fox", 64, 64, **change).tensors()
