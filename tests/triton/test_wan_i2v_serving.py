"""Wan image-to-video (img2vid) on the real tritonserver (issue 24): an INIT_IMAGE on a video request (FRAMES) is
the clip's first frame; the entry answers VIDEO equal, bit for bit, to the in-process EnginePipeline over the same
engines, over HTTP and gRPC, with WORKFLOW img2vid or implied; the stream too; the first request timed at start
is an img2vid one; `generate --image --frames` writes an .mp4 PyAV reads back as the clip; bad input (no
INIT_IMAGE to an I2V model, an INIT_IMAGE of another size, an INIT_IMAGE to a text-to-video model) is one clear
message each and the server stays healthy.

Default run: the routing and the messages without a server (a routing table over the tiny checkpoints), and the
packaged skeleton an I2V entry loads. Slow: the served tests build the tiny Wan 2.1 I2V and Wan 2.1 engines
(32x32x5, onnxruntime, about a minute each) and serve both from one tritonserver.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from trt_diffusion.errors import RuntimeInputError, ServeError
from trt_diffusion.sample_inputs import init_image, natural_workflow, request_fields
from trt_diffusion.triton import client as triton_client
from trt_diffusion.triton.client import ImageRequest

PROMPT = "a red fox running through snow"
SIZE, FRAMES = 32, 5  # built_wan_i2v's i2v bucket, and built_wan's
FIRST = init_image(SIZE, SIZE, seed=3)
T2V = "wan_t2v"  # the text-to-video entry served beside the I2V one


def served_test(test):
    """A test on the real server: its engines are built and served first (about two minutes on 2 cores)."""
    return pytest.mark.triton(pytest.mark.slow(pytest.mark.timeout(900)(test)))


def video_request(**change) -> ImageRequest:
    values = dict(prompt=PROMPT, height=SIZE, width=SIZE, steps=3, guidance_scale=5.0, seed=7, frames=FRAMES,
                  init_image=FIRST)
    values.update(change)
    return ImageRequest(**values)


# ---------------------------------------------------------------------------- without a server


@pytest.fixture
def read(monkeypatch):
    from trt_diffusion.triton.backend import pb, requests

    monkeypatch.setattr(pb, "input_array", lambda tensors, name: tensors.get(name))
    return lambda image_request: requests.read_request(image_request.tensors())


def _routing(model_dir: Path, components: tuple[str, ...], workflows: tuple[str, ...]):
    """An EnginePipeline over a routing table (no engines behind it: validation runs none)."""
    from trt_diffusion.runtime.engines import RunnerTable
    from trt_diffusion.runtime.pipeline import EnginePipeline

    table = RunnerTable()
    for component in components:
        table.add(component, None)
    return EnginePipeline(model_dir, "wan", table, workflows=workflows)


@pytest.fixture(scope="module")
def i2v_routing(tiny_model_factory):
    return _routing(tiny_model_factory("wan", variant="i2v"),
                    ("text_encoder", "image_encoder", "transformer", "vae_encoder", "vae_decoder"), ("img2vid",))


@pytest.fixture(scope="module")
def t2v_routing(tiny_model_factory):
    return _routing(tiny_model_factory("wan"), ("text_encoder", "transformer", "vae_decoder"), ("txt2img",))


def test_an_init_image_on_a_video_request_is_img2vid(read, i2v_routing):
    request = read(video_request())
    assert request.workflow is None and request.resolved_workflow == "img2vid" and request.frames == FRAMES
    np.testing.assert_array_equal(request.init_image, FIRST)
    i2v_routing.validate(request)
    i2v_routing.validate(read(video_request(workflow="img2vid")))
    assert read(video_request(frames=None)).resolved_workflow == "img2img"  # no FRAMES: an image request


# Each bad request's whole answer: one problem, said once (the pipeline joins several with "; ")
NO_IMAGE = ("WORKFLOW txt2img is not served: this WanImageToVideoPipeline checkpoint makes a clip from its first frame "
            "(its transformer takes the image's latents beside the noise): give INIT_IMAGE (served: img2vid)")
WRONG_SIZE = ("INIT_IMAGE is [32, 48, 3], expected [32, 32, 3] (the request's size; images are not resized)")
TO_TEXT_TO_VIDEO = ("WORKFLOW img2vid is not served: img2vid needs an image-to-video checkpoint "
                    "(WanImageToVideoPipeline), this one is WanPipeline, whose transformer takes no image "
                    "(served: txt2img)")


@pytest.mark.parametrize("change, message", [
    ({"init_image": None}, NO_IMAGE),
    ({"init_image": init_image(SIZE, 48)}, WRONG_SIZE),
    ({"workflow": "img2img"}, "WORKFLOW img2img is not served: the wan family has no img2img workflow (served: "
                              "img2vid)"),
])
def test_bad_img2vid_requests_are_one_clear_message(read, i2v_routing, change, message):
    with pytest.raises(RuntimeInputError) as caught:
        i2v_routing.validate(read(video_request(**change)))
    assert str(caught.value) == message


def test_an_init_image_to_a_text_to_video_model_is_refused_by_name(read, t2v_routing):
    t2v_routing.validate(read(video_request(init_image=None)))
    with pytest.raises(RuntimeInputError) as caught:
        t2v_routing.validate(read(video_request()))
    assert str(caught.value) == TO_TEXT_TO_VIDEO


def test_requests_that_are_not_about_workflows_ask_for_the_natural_one():
    """First requests, warm-ups and the preflight checks: an I2V model gets img2vid with a seeded first frame."""
    assert natural_workflow(["txt2img", "img2img"]) == "txt2img" and natural_workflow(["img2vid"]) == "img2vid"
    assert request_fields("txt2img", SIZE, SIZE) == {}
    fields = request_fields("img2vid", 32, 48)
    assert fields["workflow"] == "img2vid" and fields["init_image"].shape == (32, 48, 3)


def test_the_packaged_skeleton_has_what_an_i2v_entry_loads(tiny_model_factory, tmp_path):
    """The entry's EnginePipeline reads the model folder's skeleton: Wan 2.1 I2V's CLIP image processor too."""
    from trt_diffusion.triton.repository import copy_model_skeleton

    copy_model_skeleton(tiny_model_factory("wan", variant="i2v"), tmp_path / "model", "wan")
    assert (tmp_path / "model" / "image_processor").is_dir()
    pipeline = _routing(tmp_path / "model", ("text_encoder", "image_encoder", "transformer", "vae_encoder",
                                              "vae_decoder"), ("img2vid",))
    assert pipeline.workflows == ("img2vid",)


def _engine(component: str, inputs: dict, outputs: dict, bucket: str | None = f"{SIZE}x{SIZE}x{FRAMES}") -> dict:
    def tensors(shapes: dict) -> list:
        return [{"name": name, "dtype": "float32", "shape": shape} for name, shape in shapes.items()]

    return {"model": f"wan__{component}", "component": component, "batch": 1, "controlnet": None,
            "bucket": None if bucket is None else dict.fromkeys(("min", "opt", "max"), bucket),
            "inputs": tensors(inputs), "outputs": tensors(outputs)}


def test_the_entry_warm_up_runs_img2vid_requests(tiny_model_factory, tmp_path, monkeypatch):
    """The python warm-up (over zero stand-ins, before the server is ready) sends an I2V model img2vid requests:
    txt2img ones would be refused. Its VAE encoder's latent sides are dynamic in the manifest (named apart from
    the image's), and are the bucket's over the VAE factor. The description is the tiny Wan 2.1 I2V's as
    `package` writes it at 32x32x5."""
    import json
    from types import SimpleNamespace

    from trt_diffusion.runtime.engines import RunnerTable
    from trt_diffusion.runtime.pipeline import EnginePipeline
    from trt_diffusion.triton.backend import pb, warmup
    from trt_diffusion.triton.description import PipelineDescription

    engines = [
        _engine("text_encoder", {"input_ids": [1, 512], "attention_mask": [1, 512]}, {"hidden_states": [1, 512, 32]},
                None),
        _engine("image_encoder", {"pixel_values": [1, 3, 28, 28]}, {"image_embeds": [1, 5, 32]}, None),
        _engine("transformer", {"hidden_states": [1, 36, 2, 4, 4], "timestep": [1],
                                "encoder_hidden_states": [1, 512, 32], "encoder_hidden_states_image": [1, 5, 32]},
                {"noise_pred": [1, 16, 2, 4, 4]}),
        _engine("vae_encoder", {"video": [1, 3, FRAMES, SIZE, SIZE]}, {"latent": [1, 16, 2, -1, -1]}),
        _engine("vae_decoder", {"latent": [1, 16, 2, 4, 4]}, {"video": [1, 3, FRAMES, SIZE, SIZE]}),
    ]
    (tmp_path / "pipeline.json").write_text(json.dumps({
        "pipeline": "wan", "family": "wan", "engines": engines, "schema_version": 1, "workflows": ["img2vid"]}))
    description = PipelineDescription.read(tmp_path)
    warnings, ran = [], []
    monkeypatch.setattr(pb, "utils", lambda: SimpleNamespace(Logger=SimpleNamespace(log_warn=warnings.append)))
    run = warmup.ZeroRunner.run
    monkeypatch.setattr(warmup.ZeroRunner, "run", lambda self, feeds: ran.append(self.name) or run(self, feeds))
    pipeline = EnginePipeline(tiny_model_factory("wan", variant="i2v"), "wan", RunnerTable(), workflows=("img2vid",))
    warmup.warm_up_in_process(pipeline, description)
    assert warnings == []
    assert {"wan__image_encoder (warm-up stand-in)", "wan__vae_encoder (warm-up stand-in)"} <= set(ran)


def test_package_refuses_img2vid_without_the_image_encoder_it_runs(tiny_model_factory):
    from types import SimpleNamespace

    from trt_diffusion.families import Family
    from trt_diffusion.triton import repository

    def built(*components: str) -> list:
        return [SimpleNamespace(spec=SimpleNamespace(component=c)) for c in components]

    base = built("text_encoder", "transformer", "vae_encoder", "vae_decoder")
    wan21 = tiny_model_factory("wan", variant="i2v")
    assert repository._check_workflows(base + built("image_encoder"), Family.wan, ["img2vid"], wan21) == ("img2vid",)
    with pytest.raises(ServeError, match="img2vid on this checkpoint runs its CLIP image encoder on the INIT_IMAGE: "
                                         "the engine list has no image_encoder engine"):
        repository._check_workflows(base, Family.wan, ["img2vid"], wan21)
    wan22 = tiny_model_factory("wan", variant="i2v_two_expert")  # Wan 2.2 I2V: no image encoder to run
    assert repository._check_workflows(base, Family.wan, ["img2vid"], wan22) == ("img2vid",)


# ---------------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def i2v_workspace(built_wan_i2v) -> Path:
    return built_wan_i2v("i2v")


@pytest.fixture(scope="module")
def local_pipeline(i2v_workspace):
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import engine_runners
    from trt_diffusion.runtime.pipeline import EnginePipeline

    config = load_engines_file(i2v_workspace, check_sources=True)
    model_dir, family, table = engine_runners(config, "wan", "onnxruntime")
    return EnginePipeline(model_dir, family, table, workflows=config.models["wan"].workflows)


@pytest.fixture(scope="module")
def server(i2v_workspace, built_wan, tmp_path_factory):
    """The I2V model's repository (entry and stream: video has no ensemble) with a text-to-video entry, `wan_t2v`,
    added beside it, started with its first request timed (an img2vid one)."""
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import built_engines
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.repository import PackageOptions, package

    root = tmp_path_factory.mktemp("wan-i2v-repo")
    report = stage.package_stage(i2v_workspace, root / "repo", options=PackageOptions(ensemble=True))
    assert report.ensemble is None and report.workflows == ["img2vid"]
    t2v = load_engines_file(built_wan("split"), check_sources=True)
    package(built_engines(t2v, "wan", "onnxruntime"), t2v.models["wan"].source.path, "wan", T2V, root / "t2v",
            PackageOptions(ensemble=False, stream=False), workflows=t2v.models["wan"].workflows)
    for folder in (root / "t2v").iterdir():
        if folder.is_dir():
            shutil.copytree(folder, root / "repo" / folder.name)
    served, warmup = stage.start(root / "repo", work_dir=root / "work", first_request=True)
    try:
        yield served, warmup
    finally:
        served.stop()


def local(pipeline, request: ImageRequest, seed_offset: int = 0) -> np.ndarray:
    from trt_diffusion.runtime.pipeline import GenerationRequest

    return pipeline.generate(GenerationRequest(
        prompt=request.prompt, height=request.height, width=request.width, steps=request.steps,
        guidance_scale=request.guidance_scale, seed=request.seed + seed_offset, frames=request.frames,
        workflow=request.workflow, init_image=request.init_image)).images[0]


def assert_healthy(served, local_pipeline) -> None:
    import tritonclient.http as http

    client = http.InferenceServerClient(served.http_url)
    try:
        assert client.is_server_live() and client.is_server_ready()
    finally:
        client.close()
    good = video_request(steps=2, seed=1)
    (video,), _ = triton_client.generate_images(served.grpc_url, good, pipeline="wan", protocol="grpc")
    np.testing.assert_array_equal(video, local(local_pipeline, good))


@served_test
@pytest.mark.parametrize("protocol, workflow", [("http", None), ("grpc", "img2vid")])
def test_served_clips_equal_the_in_process_pipeline(server, local_pipeline, protocol, workflow):
    served, _ = server
    url = served.http_url if protocol == "http" else served.grpc_url
    request = video_request(num_images=2, workflow=workflow)
    videos, parameters = triton_client.generate_images(url, request, pipeline="wan", protocol=protocol)
    assert videos.shape == (2, FRAMES, SIZE, SIZE, 3) and videos.dtype == np.uint8
    for k in range(2):  # NUM_IMAGES clips: seeds SEED, SEED + 1, from the same first frame
        np.testing.assert_array_equal(videos[k], local(local_pipeline, video_request(), k))
    other = local(local_pipeline, video_request(init_image=init_image(SIZE, SIZE, seed=4)))
    assert not np.array_equal(videos[0], other)  # the first frame conditions the clip
    assert parameters["timing"]["image_encode_s"] > 0 and parameters["timing"]["steps_s"]


@served_test
def test_the_stream_and_the_first_request_are_img2vid(server, local_pipeline):
    served, warmup = server
    (first,) = warmup.first_requests  # timed at start: a txt2img request would have been refused
    assert first.size == f"{SIZE}x{SIZE}x{FRAMES}" and first.seconds > 0
    log = Path(served.log_path).read_text()  # the entry's python warm-up ran img2vid requests to the end
    assert "wan: python warm-up took" in log and "warm-up of wan stopped early" not in log
    video, previews, _ = triton_client.stream(served.grpc_url, video_request(), model="wan_stream", preview_every=1)
    np.testing.assert_array_equal(video, local(local_pipeline, video_request()))
    assert [step for step, _ in previews] == [1, 2]


@served_test
@pytest.mark.parametrize("pipeline, change, message", [
    ("wan", {"init_image": None}, NO_IMAGE),
    ("wan", {"init_image": init_image(SIZE, 48)}, WRONG_SIZE),
    (T2V, {}, TO_TEXT_TO_VIDEO),
])
def test_bad_img2vid_input_is_one_clear_error_and_the_server_stays_up(server, local_pipeline, pipeline, change,
                                                                      message):
    served, _ = server
    for protocol, url in (("grpc", served.grpc_url), ("http", served.http_url)):
        with pytest.raises(ServeError) as caught:
            triton_client.generate_images(url, video_request(**change), pipeline=pipeline, protocol=protocol)
        assert type(caught.value) is ServeError  # the request's fault: not load, not a cancel
        assert str(caught.value) == f"Triton at {url}, model {pipeline}: {message}"
    assert_healthy(served, local_pipeline)
    (clip,), _ = triton_client.generate_images(served.grpc_url, video_request(init_image=None), pipeline=T2V,
                                               protocol="grpc")  # the text-to-video entry still serves its clips
    assert clip.shape == (FRAMES, SIZE, SIZE, 3)


def _decoded(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])


@served_test
def test_generate_image_frames_writes_the_clip_as_mp4(server, local_pipeline, tmp_path, capsys):
    from PIL import Image

    from trt_diffusion.cli import main

    served, _ = server
    Image.fromarray(FIRST).save(tmp_path / "first.png")
    out = tmp_path / "fox.mp4"
    code = main(["generate", "--url", served.http_url, "--pipeline", "wan", "--prompt", PROMPT, "--steps", "3",
                 "--guidance-scale", "5", "--seed", "7", "--image", str(tmp_path / "first.png"), "--frames",
                 str(FRAMES), "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    decoded = _decoded(out)
    assert decoded.shape == (FRAMES, SIZE, SIZE, 3)
    # H.264 is lossy: the file holds this request's clip when it is much closer to it than to the next seed's
    error = np.abs(decoded.astype(int) - local(local_pipeline, video_request()).astype(int)).mean()
    assert error < 0.5 * np.abs(decoded.astype(int) - local(local_pipeline, video_request(), 1).astype(int)).mean()
    Image.fromarray(init_image(SIZE, 48)).save(tmp_path / "wide.png")  # 48x32: not the bucket's size
    capsys.readouterr()
    code = main(["generate", "--url", f"grpc://{served.grpc_url}", "--pipeline", "wan", "--prompt", PROMPT, "--image",
                 str(tmp_path / "wide.png"), "--frames", str(FRAMES), "-o", str(tmp_path / "wide.mp4")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1 and "Traceback" not in err
    assert "size 48x32x5 is not served; supported sizes: 32x32x5" in err
    assert "wide.png is 48x32 and sets the request's size (images are not resized)" in err

