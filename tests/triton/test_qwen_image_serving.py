"""Qwen-Image over Triton (issue 26): MAX_SEQUENCE_LENGTH in the request contract and `generate
--max-sequence-length`, engines.yaml's `text_length` reaching every EnginePipeline built for the model (the entry's,
through pipeline.json, and `generate --config`'s), the entry's warm-up over stand-ins for its dynamic engines.

The pure parts run by default. The served part (`slow`: the tiny model's onnxruntime engines, about 30 s to build on
2 cores, then a real tritonserver) checks that the entry's images equal the in-process EnginePipeline's bit for bit
over HTTP and gRPC with true CFG (a negative prompt, guidance > 1) and NUM_IMAGES 2, and for img2img and inpaint
(INIT_IMAGE, MASK, STRENGTH through the entry's VAE encoder); that a prompt longer than the
engines' text_length max (256) is truncated there, as in process; MAX_SEQUENCE_LENGTH end to end; that bad values
(out of range; sent to an sd15 model) are one clear error each with the server healthy after.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from trt_diffusion.errors import RuntimeInputError, ServeError
from trt_diffusion.families import Family
from trt_diffusion.runtime.engines import RunnerTable
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.tensors import TensorSpec
from trt_diffusion.triton import contract
from trt_diffusion.triton.backend import pb, requests, warmup
from trt_diffusion.triton.client import ImageRequest
from trt_diffusion.triton.description import EngineEntry, PipelineDescription

QWEN_SIZE = 64  # the bucket conftest.qwen_workspace builds
TEXT_LENGTHS = (2, 64, 256)  # its text_length (min, opt, max)
PROMPT = "a lighthouse on a cliff at dusk"
NEGATIVE = "blurry, low quality"
# the tiny tokenizer is byte-level outside the template's words (one token per character), plus the template's
# 5-token tail: 305 text tokens, past the served engines' max of 256 and below diffusers' 512
LONG_PROMPT = "fox " * 75


@pytest.fixture
def read(monkeypatch):
    """`read(ImageRequest) -> GenerationRequest` through the backend's reader, tensors as Triton hands them."""
    monkeypatch.setattr(pb, "input_array", lambda tensors, name: tensors.get(name))
    return lambda image_request: requests.read_request(image_request.tensors())


def image_request(**change) -> ImageRequest:
    values = dict(prompt=PROMPT, height=QWEN_SIZE, width=QWEN_SIZE, steps=3, guidance_scale=4.0, seed=7,
                  negative_prompt=NEGATIVE)
    values.update(change)
    return ImageRequest(**values)


def routing_table(components: dict[str, object]) -> RunnerTable:
    """Routing rows with no engine behind them: validation runs none."""
    from trt_diffusion.engines_file.engine_spec import Bucket, Size

    table = RunnerTable()
    for component, bucket in components.items():
        size = Size(QWEN_SIZE, QWEN_SIZE)
        table.add(component, None, bucket=Bucket(size, size, size) if bucket else None, batch=1)
    return table


# --- the request contract (default) ---------------------------------------------------------------------------


def test_max_sequence_length_is_an_optional_int32_input_of_every_entry():
    for stage in ("full", "stream"):
        for family in ("sd15", "qwen_image", "wan"):  # on every entry: others refuse it in the pipeline's words
            inputs = {t.name: t for t in contract.stage_io(stage, family, False)[0]}
            declared = inputs["MAX_SEQUENCE_LENGTH"]
            assert (declared.data_type, declared.dims, declared.optional) == ("TYPE_INT32", (1,), True)
    tensors = image_request(max_sequence_length=64).tensors()
    assert tensors["MAX_SEQUENCE_LENGTH"].dtype == np.int32 and tensors["MAX_SEQUENCE_LENGTH"].tolist() == [[64]]
    assert "MAX_SEQUENCE_LENGTH" not in image_request().tensors()  # left out: servers before it accept the request


def test_the_backend_reads_max_sequence_length_as_sent(read):
    assert read(image_request(max_sequence_length=64)).max_sequence_length == 64
    assert read(image_request()).max_sequence_length is None  # the family's default (512, or the engines' max)


def test_an_sd15_pipeline_refuses_max_sequence_length_in_the_runtime_words(tiny_model_factory, read):
    pipeline = EnginePipeline(tiny_model_factory("sd15"), "sd15",
                              routing_table({"text_encoder": False, "unet": True, "vae_decoder": True}))
    with pytest.raises(RuntimeInputError, match="MAX_SEQUENCE_LENGTH is the qwen_image family's"):
        pipeline.validate(read(image_request(max_sequence_length=64)))
    pipeline.validate(read(image_request()))  # without it: a good request


@pytest.mark.parametrize("value, message", [
    (300, r"MAX_SEQUENCE_LENGTH must be between 2 and 256, got 300 \(the engines' text_length max is 256"),
    (1, r"MAX_SEQUENCE_LENGTH must be between 2 and 256, got 1 \(the engines take at least 2"),
])
def test_a_qwen_pipeline_refuses_lengths_outside_its_text_length(tiny_model_factory, read, value, message):
    pipeline = EnginePipeline(tiny_model_factory("qwen_image"), "qwen_image",
                              routing_table({"text_encoder": False, "transformer": True, "vae_decoder": True}),
                              text_lengths=TEXT_LENGTHS)
    with pytest.raises(RuntimeInputError, match=message):
        pipeline.validate(read(image_request(max_sequence_length=value)))
    pipeline.validate(read(image_request(max_sequence_length=256)))


# --- what package records, what the entry builds (default) ----------------------------------------------------


def _built(text_length: str | None):
    return SimpleNamespace(spec=SimpleNamespace(option=lambda name: text_length if name == "text_length" else None))


def test_package_records_the_engines_text_length_for_the_entry(tmp_path):
    from trt_diffusion.triton.repository import _text_lengths

    assert _text_lengths([_built("2,64,256"), _built("2,64,256"), _built(None)]) == TEXT_LENGTHS  # VAE: no option
    assert _text_lengths([_built(None)]) is None  # the family's default range (or a padded family)
    with pytest.raises(ServeError, match="different text_length ranges"):
        _text_lengths([_built("2,64,256"), _built("2,128,512")])
    PipelineDescription("qwen", "qwen_image", (), text_lengths=TEXT_LENGTHS).write(tmp_path)
    assert PipelineDescription.read(tmp_path).text_lengths == TEXT_LENGTHS
    raw = json.loads((tmp_path / "pipeline.json").read_text())
    del raw["text_lengths"]  # a repository packaged before it: the default range, as it served
    (tmp_path / "pipeline.json").write_text(json.dumps(raw))
    assert PipelineDescription.read(tmp_path).text_lengths is None


def test_qwen_image_has_no_ensemble():
    from trt_diffusion.triton.repository import PackageOptions, _writes_ensemble

    assert not _writes_ensemble(Family.qwen_image, PackageOptions(ensemble=True))
    assert _writes_ensemble(Family.sd15, PackageOptions(ensemble=True))
    with pytest.raises(ValueError, match="no 'encode' stage"):
        contract.stage_io("encode", "qwen_image", False)


def _qwen_description(width: int) -> PipelineDescription:
    """The engine rows package writes for the tiny Qwen-Image (their manifests' shapes: dynamic but for widths)."""
    def specs(*items):
        return tuple(TensorSpec(dtype, shape, name) for name, dtype, shape in items)

    bucket = {"min": f"{QWEN_SIZE}x{QWEN_SIZE}", "opt": f"{QWEN_SIZE}x{QWEN_SIZE}", "max": f"{QWEN_SIZE}x{QWEN_SIZE}"}
    latent = QWEN_SIZE // 8
    return PipelineDescription("qwen", "qwen_image", (
        EngineEntry("te", "text_encoder", None, 1, None,
                    specs(("input_ids", "int64", (-1, -1)), ("attention_mask", "int64", (-1, -1))),
                    specs(("hidden_states", "float32", (-1, -1, width)))),
        EngineEntry("tr", "transformer", bucket, 1, None,
                    specs(("hidden_states", "float32", (-1, -1, -1, 64)), ("timestep", "float32", (-1,)),
                          ("encoder_hidden_states", "float32", (-1, -1, width)),
                          ("encoder_hidden_states_mask", "int64", (-1, -1))),
                    specs(("noise_pred", "float32", (-1, -1, -1, 64)))),
        EngineEntry("vd", "vae_decoder", bucket, 1, None, specs(("latent", "float32", (1, 16, latent, latent))),
                    specs(("images", "float32", (1, 3, QWEN_SIZE, QWEN_SIZE))))),
        text_lengths=TEXT_LENGTHS)


def test_the_entry_warm_up_runs_qwen_image_with_true_cfg(tiny_model_factory, monkeypatch):
    """Its text encoder and transformer are dynamic (text length, batch, patch grid): stand-ins shaped after their
    first input let the real loop run once per bucket, with an empty negative prompt (true CFG's second call)."""
    folder = tiny_model_factory("qwen_image")
    width = json.loads((folder / "transformer" / "config.json").read_text())["joint_attention_dim"]
    description = _qwen_description(width)
    follower = warmup._stand_in(description.engines[0], 8, "qwen_image")
    assert follower.run({"input_ids": np.zeros((1, 40), np.int64), "attention_mask": np.zeros((1, 40), np.int64)}
                        )["hidden_states"].shape == (1, 40, width)
    assert warmup._stand_in(description.engines[0], 8, "sd15") is None  # other families' dynamic engines: as before

    warnings, calls = [], []
    logger = SimpleNamespace(log_warn=warnings.append, log_info=lambda message: None)
    monkeypatch.setattr(pb, "utils", lambda: SimpleNamespace(Logger=logger))
    pipeline = EnginePipeline(folder, "qwen_image", RunnerTable(), text_lengths=TEXT_LENGTHS)
    generate = pipeline.generate
    monkeypatch.setattr(pipeline, "generate", lambda request: calls.append(request) or generate(request))
    warmup.warm_up_in_process(pipeline, description)
    assert not warnings, warnings
    assert [(c.height, c.width, c.negative_prompt) for c in calls] == [(QWEN_SIZE, QWEN_SIZE, "")]


def test_first_request_and_sample_requests_carry_qwen_image_true_cfg():
    from trt_diffusion.sample_inputs import cfg_fields

    assert cfg_fields("qwen_image") == cfg_fields(Family.qwen_image) == {"negative_prompt": ""}
    assert cfg_fields("sd15") == cfg_fields("flux") == {}  # CFG on GUIDANCE_SCALE alone: requests as before


# --- served (slow) --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_model(qwen_workspace):
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import engine_runners

    config = load_engines_file(qwen_workspace, check_sources=True)
    model_dir, family, table = engine_runners(config, "qwen", "onnxruntime")
    assert config.models["qwen"].text_lengths == TEXT_LENGTHS
    return SimpleNamespace(model_dir=model_dir, family=family, table=table)


@pytest.fixture(scope="module")
def local_pipeline(qwen_model):
    """The in-process pipeline over the same engines, told their text_length (as generate --config does)."""
    return EnginePipeline(qwen_model.model_dir, qwen_model.family, qwen_model.table, text_lengths=TEXT_LENGTHS)


@pytest.fixture(scope="module")
def server(qwen_workspace, tmp_path_factory):
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.repository import PackageOptions

    root = tmp_path_factory.mktemp("qwen-repo")
    report = stage.package_stage(qwen_workspace, root / "repo", options=PackageOptions(ensemble=True))
    assert report.ensemble is None  # the entry and the stream only
    served, warm = stage.start(root / "repo", work_dir=root / "work", first_request=True)
    try:
        yield SimpleNamespace(server=served, warmup=warm, repo=root / "repo")
    finally:
        served.stop()


def local(pipeline, request: ImageRequest, seed_offset: int = 0) -> np.ndarray:
    return pipeline.generate(GenerationRequest(
        prompt=request.prompt, negative_prompt=request.negative_prompt, height=request.height, width=request.width,
        steps=request.steps, guidance_scale=request.guidance_scale, seed=request.seed + seed_offset,
        max_sequence_length=request.max_sequence_length, workflow=request.workflow, init_image=request.init_image,
        mask=request.mask, strength=request.strength)).images[0]


def served_images(server, request: ImageRequest, protocol: str = "grpc") -> np.ndarray:
    from trt_diffusion.triton import client as triton_client

    url = server.server.http_url if protocol == "http" else server.server.grpc_url
    return triton_client.generate_images(url, request, protocol=protocol)[0]


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_images_equal_the_in_process_pipeline(server, local_pipeline, protocol):
    """True CFG (a negative prompt, guidance 4 > 1), NUM_IMAGES 2: seeds SEED and SEED + 1, bit for bit."""
    images = served_images(server, image_request(num_images=2), protocol)
    assert images.shape == (2, QWEN_SIZE, QWEN_SIZE, 3) and images.dtype == np.uint8
    for k in range(2):
        np.testing.assert_array_equal(images[k], local(local_pipeline, image_request(), k))
    assert not np.array_equal(images[0], images[1])


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_served_img2img_and_inpaint_equal_the_in_process_pipeline(server, local_pipeline):
    """The entry's image workflows (QwenImageImg2Img/InpaintPipeline's starts over the served VAE encoder), with true
    CFG, each bit for bit the in-process image; the workflow follows from the inputs where WORKFLOW is left out."""
    from trt_diffusion.sample_inputs import init_image, inpaint_mask

    image, mask = init_image(QWEN_SIZE, QWEN_SIZE, 4), inpaint_mask(QWEN_SIZE, QWEN_SIZE, 4)
    img2img = image_request(init_image=image, strength=0.75, seed=4)
    inpaint = image_request(init_image=image, mask=mask, strength=0.6, seed=4)
    for request, protocol in ((img2img, "grpc"), (inpaint, "http")):
        expected = local(local_pipeline, request)
        np.testing.assert_array_equal(served_images(server, request, protocol)[0], expected)
    assert not np.array_equal(local(local_pipeline, img2img), local(local_pipeline, image_request(seed=4)))
    assert PipelineDescription.read(server.repo / "qwen" / "1").workflows == ("txt2img", "img2img", "inpaint")


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_the_entry_truncates_where_its_engines_text_length_ends(server, local_pipeline, qwen_model):
    """A 305-token prompt on engines built to 256: the entry (told by pipeline.json) truncates at 256, as the
    in-process pipeline told the range does; one left at the default range would keep all 305 (ONNX Runtime
    takes the longer sequence), another image."""
    assert PipelineDescription.read(server.repo / "qwen" / "1").text_lengths == TEXT_LENGTHS
    request = image_request(prompt=LONG_PROMPT)
    image = served_images(server, request)[0]
    np.testing.assert_array_equal(image, local(local_pipeline, request))
    default_range = EnginePipeline(qwen_model.model_dir, qwen_model.family, qwen_model.table)
    assert not np.array_equal(image, local(default_range, request))
    # MAX_SEQUENCE_LENGTH 256 is then what the default asks
    np.testing.assert_array_equal(served_images(server, image_request(prompt=LONG_PROMPT, max_sequence_length=256),
                                                "http")[0], image)


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_max_sequence_length_end_to_end(server, local_pipeline, qwen_workspace, tmp_path):
    """MAX_SEQUENCE_LENGTH 16 over Triton, `generate --url --max-sequence-length 16` and `generate --config
    --max-sequence-length 16`: the in-process image of the same request (the prompt cut to 16 tokens)."""
    from PIL import Image

    from trt_diffusion.cli import main

    request = image_request(max_sequence_length=16)
    expected = local(local_pipeline, request)
    assert not np.array_equal(expected, local(local_pipeline, image_request()))  # 16 of its 35 tokens: another image
    np.testing.assert_array_equal(served_images(server, request)[0], expected)
    common = ["--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--guidance-scale", "4", "--steps", "3", "--seed",
              "7", "--height", str(QWEN_SIZE), "--width", str(QWEN_SIZE), "--max-sequence-length", "16"]
    for where in (["--url", server.server.http_url], ["--config", str(qwen_workspace)]):
        out = tmp_path / f"{where[0].strip('-')}.png"
        assert main(["generate", *where, *common, "-o", str(out)]) == 0
        np.testing.assert_array_equal(np.asarray(Image.open(out)), expected)


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
@pytest.mark.parametrize("value, message", [
    (300, r"MAX_SEQUENCE_LENGTH must be between 2 and 256, got 300 \(the engines' text_length max is 256"),
    (0, r"MAX_SEQUENCE_LENGTH must be between 2 and 256, got 0"),
])
def test_a_bad_max_sequence_length_is_one_clear_error_and_the_server_stays_up(server, local_pipeline, value,
                                                                              message):
    for protocol in ("http", "grpc"):
        with pytest.raises(ServeError, match=message):
            served_images(server, image_request(max_sequence_length=value), protocol)
    np.testing.assert_array_equal(served_images(server, image_request())[0], local(local_pipeline, image_request()))


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_generate_config_refuses_a_bad_max_sequence_length_without_a_traceback(qwen_workspace, tmp_path, capsys):
    from trt_diffusion.cli import main

    code = main(["generate", "--config", str(qwen_workspace), "--prompt", PROMPT, "--steps", "3", "--height",
                 str(QWEN_SIZE), "--width", str(QWEN_SIZE), "--max-sequence-length", "300", "-o",
                 str(tmp_path / "x.png")])
    captured = capsys.readouterr()
    assert code == 1 and "MAX_SEQUENCE_LENGTH must be between 2 and 256, got 300" in captured.err
    assert "Traceback" not in captured.err + captured.out and not (tmp_path / "x.png").exists()


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_the_warm_up_and_the_first_request_run_qwen_image(server):
    """The entry's python warm-up ran the loop over its stand-ins (no 'stopped early' warning), and the first
    request was served and timed at the bucket (with true CFG: an empty negative prompt)."""
    log = Path(server.server.log_path).read_text(errors="replace")
    assert "qwen: python warm-up took" in log and "stopped early" not in log
    assert [r.size for r in server.warmup.first_requests] == [f"{QWEN_SIZE}x{QWEN_SIZE}"]
    assert server.warmup.first_requests[0].seconds > 0


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_the_stream_answers_the_entry_image(server, local_pipeline):
    from trt_diffusion.triton import client as triton_client

    image, previews, _ = triton_client.stream(server.server.grpc_url, image_request(), model="qwen_stream",
                                              preview_every=1)
    np.testing.assert_array_equal(image, local(local_pipeline, image_request()))
    assert [step for step, _ in previews] == [1, 2]
    assert all(p.shape == (QWEN_SIZE // 8, QWEN_SIZE // 8, 3) for _, p in previews)


@pytest.fixture(scope="module")
def sd15_server(sd15_engines, tmp_path_factory):
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.repository import PackageOptions, package

    root = tmp_path_factory.mktemp("sd15-max-sequence-length")
    package(sd15_engines.engines, sd15_engines.model_dir, sd15_engines.family, sd15_engines.name, root / "repo",
            PackageOptions(ensemble=False, stream=False))
    served, _ = stage.start(root / "repo", work_dir=root / "work", first_request=False)
    try:
        yield served
    finally:
        served.stop()


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_max_sequence_length_to_an_sd15_model_is_refused_and_the_server_stays_up(sd15_server, sd15_engines, tmp_path,
                                                                               capsys):
    from trt_diffusion.cli import main
    from trt_diffusion.triton import client as triton_client

    request = ImageRequest(PROMPT, 64, 64, steps=2, seed=1)
    for protocol, url in (("http", sd15_server.http_url), ("grpc", sd15_server.grpc_url)):
        with pytest.raises(ServeError, match="MAX_SEQUENCE_LENGTH is the qwen_image family's"):
            triton_client.generate_images(url, ImageRequest(PROMPT, 64, 64, steps=2, seed=1, max_sequence_length=64),
                                          protocol=protocol)
    assert triton_client.generate_images(sd15_server.grpc_url, request, protocol="grpc")[0].shape == (1, 64, 64, 3)
    # in process, the same words (exit 1, no traceback)
    code = main(["generate", "--config", str(sd15_engines.config_path), "--prompt", PROMPT, "--steps", "2",
                 "--height", "64", "--width", "64", "--max-sequence-length", "64", "-o", str(tmp_path / "x.png")])
    captured = capsys.readouterr()
    assert code == 1 and "MAX_SEQUENCE_LENGTH is the qwen_image family's" in captured.err
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_preflight_passes_in_process_and_over_the_served_entry(server, qwen_workspace, tmp_path):
    """The pre-launch checklist on Qwen-Image (true CFG, per-prompt text lengths): in process every check that
    applies passes and the quality baseline is saved; over the served entry (gRPC) reproducibility, buckets,
    memory, isolation, cancellation and quality pass against that baseline, bit for bit. The overload check is
    the entry's queue policy, the same for every family (test_served.py drives it on sd15)."""
    from preflight_settings import with_fast_preflight

    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.preflight.run import run_preflight

    config = load_engines_file(with_fast_preflight(qwen_workspace, tmp_path / "settings"))
    saved = run_preflight(config, save_baseline=True, in_process=True, target="onnxruntime",
                          out_dir=tmp_path / "in-process")
    assert saved.baseline is not None
    status = {check.name: check.status for check in saved.report.checks}
    assert all(s in ("pass", "n/a") for s in status.values()), {c.name: c.failures for c in saved.report.checks}
    assert status["reproducibility"] == status["isolation"] == status["cancellation"] == "pass", status
    served = run_preflight(config, url=server.server.grpc_url, skip=["overload"], target="onnxruntime",
                           out_dir=tmp_path / "served")
    checks = {check.name: check for check in served.report.checks}
    assert {n: c.status for n, c in checks.items()} == {
        "reproducibility": "pass", "buckets": "pass", "memory": "pass", "isolation": "pass", "cancellation": "pass",
        "plugins": "n/a", "quality": "pass"}, {n: c.failures for n, c in checks.items()}
    assert all(row["psnr_db"] == float("inf") for row in checks["quality"].rows)  # served = in process
