"""Image-conditioned requests (img2img, inpaint) on the real tritonserver (issue 25): served images equal the
in-process EnginePipeline's over the same engines, bit for bit, over HTTP and gRPC; the workflow follows from
the inputs; bad inputs are refused in the project's words and leave the server healthy; requests of mixed
workflows batched together each equal their own unbatched image; `generate --image/--mask` (served and
--config) end to end. The ensemble and the streaming entry need a second server: `slow` (test_serving.py sends
image inputs through the ensemble of its txt2img-only model in the default run).

The engines: the session's tiny sd15 build (tests/conftest.py `built_sd15`), copied, with `workflows: [txt2img,
img2img, inpaint]` added, which adds the VAE encoder: the only engine this module builds (about 15 s). The
entry gathers up to BATCH requests for BATCH_DELAY_MS: the UNet is built at batch 2 (CFG batched), so two
no-CFG requests (guidance 1) share a call, which is what the mixed-workflow batch test uses.
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from trt_diffusion.errors import ServeError
from trt_diffusion.sample_inputs import init_image, inpaint_mask
from trt_diffusion.triton import client as triton_client
from trt_diffusion.triton.client import ImageRequest

pytestmark = [pytest.mark.triton, pytest.mark.timeout(600)]

PROMPT = "a lighthouse on a cliff at dusk"
SIZE = 64
WORKFLOWS = ["txt2img", "img2img", "inpaint"]
BATCH = 6  # requests one execute of the entry may gather (the batch test sends six: they run at once)
# how long the entry waits for partners (a lone request waits this long): the batch test's six requests, sent
# together, arrive within it even on 2 busy cores (set batch_requests: no-CFG requests share the batch-2 UNet)
BATCH_DELAY_MS = 250
IMAGE = init_image(SIZE, SIZE, seed=3)
MASK = inpaint_mask(SIZE, SIZE, seed=3)


@dataclass
class Served:
    server: object
    report: object
    local: object  # the in-process EnginePipeline over the same engines and workflows
    config_path: Path

    def url(self, protocol: str) -> str:
        return self.server.http_url if protocol == "http" else self.server.grpc_url


@pytest.fixture(scope="module")
def image_workspace(built_sd15, tmp_path_factory) -> Path:
    """engines.yaml of built_sd15 with the image workflows declared, in a copy of its workspace: only the VAE
    encoder is new (the shared build stays untouched)."""
    from trt_diffusion import api

    root = tmp_path_factory.mktemp("image-workflows")
    shutil.copytree(built_sd15.parent / "build", root / "build", ignore=shutil.ignore_patterns("reports"))
    data = yaml.safe_load(built_sd15.read_text())
    data["build"]["workspace"] = str(root / "build")
    (model,) = data["models"].values()
    model["workflows"] = WORKFLOWS
    path = root / "engines.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    report = api.build(path, target="onnxruntime", component="vae_encoder")
    assert not report.failed, [o.error for o in report.failed]
    return path


@pytest.fixture(scope="module")
def local_pipeline(image_workspace):
    """The in-process EnginePipeline over the same engines, with engines.yaml's workflows."""
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import built_engines, table_from_engines
    from trt_diffusion.runtime.pipeline import EnginePipeline

    config = load_engines_file(image_workspace, check_sources=True)
    (name,) = config.models
    engines = built_engines(config, name, "onnxruntime")
    assert "vae_encoder" in {e.spec.component for e in engines}
    return EnginePipeline(config.models[name].source.path, "sd15", table_from_engines(engines),
                          workflows=config.models[name].workflows)


def _serve(image_workspace, local_pipeline, root: Path, options):
    from trt_diffusion.triton import stage

    report = stage.package_stage(image_workspace, root / "repo", options=options)  # workflows from engines.yaml
    assert report.workflows == WORKFLOWS
    server, _ = stage.start(root / "repo", work_dir=root / "work", first_request=False)
    return Served(server, report, local_pipeline, image_workspace)


@pytest.fixture(scope="module")
def served(image_workspace, local_pipeline, tmp_path_factory):
    """The entry alone (no ensemble, no stream: each is four or two more python processes to start)."""
    from trt_diffusion.triton.repository import PackageOptions

    options = PackageOptions(ensemble=False, stream=False, batch_requests=BATCH, batch_delay_ms=BATCH_DELAY_MS,
                             max_queue_size=16)
    served = _serve(image_workspace, local_pipeline, tmp_path_factory.mktemp("image-workflows-serving"), options)
    try:
        yield served
    finally:
        served.server.stop()


@pytest.fixture(scope="module")
def served_ensemble(image_workspace, local_pipeline, tmp_path_factory):
    """The ensemble and the streaming entry too (a second server: slow tests only)."""
    from trt_diffusion.triton.repository import PackageOptions

    served = _serve(image_workspace, local_pipeline, tmp_path_factory.mktemp("image-workflows-ensemble"),
                    PackageOptions())
    try:
        yield served
    finally:
        served.server.stop()


def request(**change) -> ImageRequest:
    values = dict(prompt=PROMPT, height=SIZE, width=SIZE, steps=4, guidance_scale=7.5, seed=0)
    values.update(change)
    return ImageRequest(**values)


def img2img(**change) -> ImageRequest:
    return request(**{"init_image": IMAGE, **change})


def inpaint(**change) -> ImageRequest:
    return request(**{"init_image": IMAGE, "mask": MASK, **change})


def remote(served: Served, image_request: ImageRequest, *, protocol: str = "grpc", model: str | None = None
           ) -> np.ndarray:
    url = served.url(protocol)
    module = triton_client.client_module(protocol)
    client = triton_client.connect(url, protocol, 120.0)
    try:
        return triton_client.infer(client, module, model or served.report.entry, image_request, protocol=protocol,
                                   timeout_s=120.0, url=url)
    finally:
        client.close()


def local_image(served: Served, r: ImageRequest) -> np.ndarray:
    from trt_diffusion.runtime.pipeline import GenerationRequest

    return served.local.generate(GenerationRequest(
        prompt=r.prompt, negative_prompt=r.negative_prompt, height=r.height, width=r.width, steps=r.steps,
        guidance_scale=r.guidance_scale, seed=r.seed, scheduler=r.scheduler or "default", workflow=r.workflow,
        init_image=r.init_image, mask=r.mask, strength=r.strength)).images[0]


def assert_healthy(served: Served) -> None:
    import tritonclient.http as http

    client = http.InferenceServerClient(served.server.http_url)
    try:
        assert client.is_server_live() and client.is_server_ready()
    finally:
        client.close()
    image_request = img2img(steps=2, seed=1)
    np.testing.assert_array_equal(remote(served, image_request), local_image(served, image_request))


# ---------------------------------------------------------------------------- images


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_img2img_and_inpaint_equal_the_in_process_pipeline(served, protocol):
    txt2img = local_image(served, request(seed=7))
    # strength 0.7 of 10 steps keeps 7 (as in diffusers), though 0.7 as float32 times 10 is 6.99999988
    for image_request in (img2img(seed=7, workflow="img2img"), img2img(seed=7, strength=0.7, steps=10),
                          inpaint(seed=7, workflow="inpaint"), inpaint(seed=7, strength=0.75, negative_prompt="fog")):
        image = remote(served, image_request, protocol=protocol)
        assert image.dtype == np.uint8 and image.shape == (SIZE, SIZE, 3)
        np.testing.assert_array_equal(image, local_image(served, image_request))
        assert not np.array_equal(image, txt2img)  # the init image changed the result


@pytest.mark.slow  # its own server with the ensemble and the stream (about 60 s on 2 cores)
def test_the_ensemble_and_the_stream_serve_them_too(served_ensemble):
    served = served_ensemble
    for image_request in (img2img(seed=8, strength=0.5), inpaint(seed=8)):
        expected = local_image(served, image_request)
        np.testing.assert_array_equal(remote(served, image_request, model=served.report.ensemble), expected)
        image, previews, _ = triton_client.stream(served.server.grpc_url, image_request,
                                                  model=f"{served.report.entry}_stream", preview_every=1)
        np.testing.assert_array_equal(image, expected)
        assert previews  # the trimmed schedule still previews its steps
    for bad, message in BAD_INPUTS[:4]:  # the encode stage refuses them before any engine runs
        with pytest.raises(ServeError, match=message):
            remote(served, bad, model=served.report.ensemble)
    assert_healthy(served)


def test_the_workflow_follows_from_the_inputs(served):
    """No WORKFLOW: an INIT_IMAGE means img2img, with a MASK inpaint, neither txt2img (as the Clarifications say)."""
    implied = remote(served, img2img(seed=9))
    np.testing.assert_array_equal(implied, remote(served, img2img(seed=9, workflow="img2img")))
    implied = remote(served, inpaint(seed=9))
    np.testing.assert_array_equal(implied, remote(served, inpaint(seed=9, workflow="inpaint")))
    assert not np.array_equal(remote(served, img2img(seed=9)), implied)
    np.testing.assert_array_equal(remote(served, request(seed=9, workflow="txt2img")), local_image(served, request(seed=9)))


def test_the_entry_declares_its_workflows(served):
    import tritonclient.http as http

    client = http.InferenceServerClient(served.server.http_url)
    try:
        config = client.get_model_config(served.report.entry)
    finally:
        client.close()
    assert config["parameters"]["workflows"]["string_value"] == "txt2img;img2img;inpaint"
    # batch_requests set: the delay is kept though CFG requests cannot share the batch-2 UNet (no-CFG ones can)
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == BATCH_DELAY_MS * 1000
    inputs = {i["name"]: i for i in config["input"]}
    assert inputs["INIT_IMAGE"]["data_type"] == "TYPE_UINT8" and [int(d) for d in inputs["MASK"]["dims"]] == [-1, -1]


# ---------------------------------------------------------------------------- bad input

SMALL = init_image(32, 32)
BAD_INPUTS = [
    (img2img(init_image=SMALL), r"INIT_IMAGE is \[32, 32, 3\], expected \[64, 64, 3\] \(the request's size; images "
                                r"are not resized\)"),
    (request(init_image=init_image(96, 96), height=96, width=96), "size 96x96 is not served; supported sizes: 64x64"),
    (inpaint(mask=MASK[:32]), r"MASK is \[32, 64\], expected \[64, 64\]"),
    (img2img(strength=0.0), r"STRENGTH must be in \(0, 1\], got 0.0"),
    (inpaint(strength=1.5), r"STRENGTH must be in \(0, 1\], got 1.5"),
    (img2img(strength=float("nan")), r"STRENGTH must be in \(0, 1\], got nan"),
    (img2img(strength=0.1, steps=4), "STRENGTH 0.1 keeps no step of 4: raise STEPS or STRENGTH"),
    (request(workflow="magic"), "unknown WORKFLOW 'magic'; choose one of txt2img, img2img, inpaint, edit"),
    (img2img(workflow="edit"), "WORKFLOW edit is not served: the sd15 family has no edit workflow"),
    (request(workflow="img2img"), "WORKFLOW img2img needs INIT_IMAGE"),
    (request(workflow="inpaint", init_image=IMAGE), "WORKFLOW inpaint needs MASK"),
    (request(mask=MASK), "a MASK needs the INIT_IMAGE it masks"),
    (img2img(workflow="img2img", mask=MASK), r"WORKFLOW img2img takes no MASK \(inpaint does\)"),
    (request(strength=0.5), "WORKFLOW txt2img takes no STRENGTH"),
]


@pytest.mark.parametrize("bad,message", BAD_INPUTS, ids=[m.split(";")[0][:32].replace("\\", "") for _, m in BAD_INPUTS])
def test_bad_image_input_is_a_clear_error(served, bad, message):
    with pytest.raises(ServeError, match=message) as caught:
        remote(served, bad)
    assert type(caught.value) is ServeError  # the request's fault: not load, not a cancel


def test_bad_image_inputs_over_http_then_the_server_is_healthy(served):
    for bad, message in BAD_INPUTS:
        with pytest.raises(ServeError, match=message):
            remote(served, bad, protocol="http")
    assert_healthy(served)


def test_the_client_refuses_what_no_server_could_take(served):
    with pytest.raises(ServeError, match="INIT_IMAGE must be uint8"):
        remote(served, img2img(init_image=IMAGE.astype(np.float32) / 255))
    with pytest.raises(ServeError, match=r"MASK must be \[H, W\], got \[64, 64, 3\]"):
        remote(served, inpaint(mask=IMAGE))
    with pytest.raises(ServeError, match="each side must be 1 to 8192 pixels"):
        remote(served, img2img(init_image=np.zeros((8200, 1, 3), np.uint8)))


# ---------------------------------------------------------------------------- batching


def together(served: Served, requests: list[ImageRequest]) -> list[tuple[np.ndarray, dict]]:
    """Send all at once over gRPC (clients connected first, then a barrier): they reach the queue within
    BATCH_DELAY_MS. (images, response parameters) each."""
    import tritonclient.grpc as grpc

    barrier = threading.Barrier(len(requests))

    def one(r):
        client = triton_client.connect(served.server.grpc_url, "grpc", 120.0)
        try:
            barrier.wait()
            return triton_client.infer_images(client, grpc, served.report.entry, r, protocol="grpc", timeout_s=120.0,
                                              url=served.server.grpc_url)
        finally:
            client.close()

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def test_mixed_workflows_sent_together_each_equal_their_own_image(served):
    """Two each of txt2img, img2img and inpaint, no CFG (two share the batch-2 UNet), all at once: each image
    equals the in-process image of its request alone, and no denoiser call took more than a pair. (Triton's
    batcher itself keeps requests with different sets of inputs in different executes: see the next test.)"""
    requests = [request(seed=31, guidance_scale=1.0), img2img(seed=32, guidance_scale=1.0),
                inpaint(seed=33, guidance_scale=1.0), request(seed=34, guidance_scale=1.0, prompt="a paper boat"),
                img2img(seed=35, guidance_scale=1.0, prompt="a red fox"), inpaint(seed=36, guidance_scale=1.0)]
    results = together(served, requests)
    for r, (images, parameters) in zip(requests, results):
        np.testing.assert_array_equal(images[0], local_image(served, r))
        assert parameters["timing"]["batch"] in ([1], [2])


def test_one_execute_of_several_strengths_is_split_by_the_batch_key(served):
    """Four img2img requests with the same inputs (so Triton puts them in one execute, after BATCH_DELAY_MS),
    strengths 0.8, 0.5, 0.8, 0.65, no CFG: the two at 0.8 share the batch-2 UNet's calls, the others run alone
    (a different strength is a different trimmed schedule); grouping by arrival alone would have paired
    0.8 with 0.5. TIMING's `batch` says how many shared the denoiser calls; every image equals its own."""
    requests = [img2img(seed=41 + i, guidance_scale=1.0, strength=strength, prompt=prompt) for i, (strength, prompt)
                in enumerate([(0.8, PROMPT), (0.5, "a red fox"), (0.8, "a paper boat"), (0.65, PROMPT)])]
    results = together(served, requests)
    for r, (images, _) in zip(requests, results):
        np.testing.assert_array_equal(images[0], local_image(served, r))
    assert [parameters["timing"]["batch"] for _, parameters in results] == [[2], [1], [2], [1]]
    queued = [parameters["timing"]["queue_s"] for _, parameters in results]
    assert min(queued) >= BATCH_DELAY_MS / 1000 / 2  # none sent on early: they waited for partners together


# ---------------------------------------------------------------------------- the command line


def _cli(*argv: str) -> int:
    from trt_diffusion.cli import main

    return main(list(argv))


def _png(path: Path, array: np.ndarray) -> Path:
    from PIL import Image

    Image.fromarray(array).save(path)
    return path


def test_generate_image_and_mask_write_the_served_image_and_record_the_request(served, tmp_path):
    from PIL import Image

    from trt_diffusion.image_files import read_png_parameters

    image = _png(tmp_path / "photo.png", IMAGE)
    mask = _png(tmp_path / "mask.png", np.repeat(MASK[..., None], 3, axis=2))  # RGB: read as grayscale
    out = tmp_path / "out.png"
    # no --width/--height: the image's size
    assert _cli("generate", "--url", served.server.http_url, "--prompt", PROMPT, "--steps", "4", "--seed", "5",
                "--image", str(image), "--mask", str(mask), "--strength", "0.75", "-o", str(out)) == 0
    expected = local_image(served, inpaint(seed=5, strength=0.75))
    np.testing.assert_array_equal(np.asarray(Image.open(out)), expected)
    recorded = read_png_parameters(out)
    assert (recorded.workflow, recorded.strength, recorded.init_image, recorded.mask) == (
        "inpaint", 0.75, "photo.png", "mask.png")  # relative to the PNG's folder: what --from reads
    with Image.open(out) as written:
        assert "Workflow: inpaint, Denoising strength: 0.75" in written.text["parameters"]
    # --from repeats it, reading the input files it names
    assert _cli("generate", "--url", f"grpc://{served.server.grpc_url}", "--from", str(out), "-o", str(out)) == 0
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "out-0001.png")), expected)
    # img2img: the default strength is what the PNG records
    assert _cli("generate", "--url", f"grpc://{served.server.grpc_url}", "--prompt", PROMPT, "--steps", "4", "--seed", "5",
                "--image", str(image), "--width", "64", "-o", str(tmp_path / "i2i.png")) == 0
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "i2i.png")), local_image(served, img2img(seed=5)))
    assert (read_png_parameters(tmp_path / "i2i.png").workflow, read_png_parameters(tmp_path / "i2i.png").strength) \
        == ("img2img", 0.8)


def test_generate_refuses_images_it_would_have_to_resize(served, tmp_path, capsys):
    image = _png(tmp_path / "photo.png", IMAGE)
    small_mask = _png(tmp_path / "mask.png", MASK[:32, :32])
    assert _cli("generate", "--url", served.server.http_url, "--prompt", PROMPT, "--image", str(image),
                "--width", "32", "--height", "32") == 1
    assert "images are not resized" in " ".join(capsys.readouterr().err.split())
    assert _cli("generate", "--url", served.server.http_url, "--prompt", PROMPT, "--image", str(image),
                "--mask", str(small_mask)) == 1
    assert "the mask must be the image's size" in " ".join(capsys.readouterr().err.split())
    assert _cli("generate", "--url", served.server.http_url, "--prompt", PROMPT, "--mask", str(small_mask)) == 1
    assert "a mask needs the --image it masks" in " ".join(capsys.readouterr().err.split())
    # the server's own refusal reaches the command line in its words
    assert _cli("generate", "--url", served.server.http_url, "--prompt", PROMPT, "--image", str(image),
                "--strength", "2") == 1
    assert "STRENGTH must be in (0, 1], got 2.0" in " ".join(capsys.readouterr().err.split())


def test_generate_config_runs_the_image_workflows_in_process(served, tmp_path):
    from PIL import Image

    image = _png(tmp_path / "photo.png", IMAGE)
    mask = _png(tmp_path / "mask.png", MASK)
    out = tmp_path / "local.png"
    assert _cli("generate", "--config", str(served.config_path), "--prompt", PROMPT, "--steps", "4", "--seed", "6",
                "--image", str(image), "--mask", str(mask), "-o", str(out)) == 0
    np.testing.assert_array_equal(np.asarray(Image.open(out)), local_image(served, inpaint(seed=6)))
    np.testing.assert_array_equal(np.asarray(Image.open(out)), remote(served, inpaint(seed=6)))
