"""The official `openai` client against the API in front of a real tritonserver serving the tiny sd15 (txt2img,
img2img, inpaint): images equal, decoded pixel for pixel, to the same request sent straight to Triton; n > 1;
every refusal with its status and OpenAI's error shape; a client that gives up cancels its request in Triton; the
server keeps serving after each bad request; a batch of edit lines equals the same edits sent online."""

from __future__ import annotations

import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from trt_diffusion.triton.client import ImageRequest, generate_images

pytestmark = [pytest.mark.slow, pytest.mark.triton]

KEY = "test-key"
SIZE = 64
PROMPT = "a lighthouse on a cliff at dusk"
QUEUE = 1  # the entry's max_queue_size: a third request while two run waits, a fourth is refused
BODY_CAP = 1 << 20
LONG_STEPS = 1000  # seconds of work: only cancellation ends it early
HANG_GUARD_S = 120
CANCELLED_LINE = "request cancelled after"  # what the entry logs when it stops a request


@dataclass
class Served:
    server: object
    api: object
    entry: str

    def client(self, **options):
        import openai

        options.setdefault("max_retries", 0)  # a refusal is the answer under test, not something to retry
        return openai.OpenAI(base_url=self.api.url, api_key=options.pop("api_key", KEY), **options)

    def cancelled_in_log(self) -> int:
        return self.server.log_path.read_text(errors="replace").count(CANCELLED_LINE)


@pytest.fixture(scope="module")
def served(built_sd15_workflows, tmp_path_factory):
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.openai_api.server import ApiServer
    from trt_diffusion.openai_api.settings import ApiSettings
    from trt_diffusion.runtime.loader import built_engines
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.repository import PackageOptions, package

    config = load_engines_file(built_sd15_workflows, check_sources=True)
    (name,) = config.models
    model = config.models[name]
    root = tmp_path_factory.mktemp("openai-api")
    report = package(built_engines(config, name, "onnxruntime"), model.source.path, model.family, name,
                     root / "repo", PackageOptions(max_queue_size=QUEUE, ensemble=False, stream=False),
                     workflows=model.workflows)
    server, _ = stage.start(root / "repo", work_dir=root / "work", first_request=False)
    api = ApiServer(ApiSettings(server.grpc_url, port=0, api_key=KEY, max_body_bytes=BODY_CAP,
                                state_dir=root / "state")).start()
    try:
        yield Served(server, api, report.entry)
    finally:
        api.stop()
        server.stop()


def decoded(item) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(item.b64_json))) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def over_triton(served: Served, **fields) -> np.ndarray:
    values = dict(prompt=PROMPT, height=SIZE, width=SIZE, steps=3, guidance_scale=7.5, seed=0)
    values.update(fields)
    images, _ = generate_images(served.server.grpc_url, ImageRequest(**values), pipeline=served.entry,
                                protocol="grpc", timeout_s=120)
    return images


def png(array: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_generation_equals_the_same_request_over_triton(served):
    result = served.client().images.generate(
        model=served.entry, prompt=PROMPT, size=f"{SIZE}x{SIZE}", response_format="b64_json",
        extra_body={"seed": 11, "num_inference_steps": 3, "guidance_scale": 7.5, "negative_prompt": "blurry"})
    (item,) = result.data
    image = decoded(item)
    expected = over_triton(served, seed=11, negative_prompt="blurry")[0]
    assert image.shape == (SIZE, SIZE, 3) and image.std() > 0
    assert np.array_equal(image, expected)
    # another seed is another image: the comparison above can fail
    assert not np.array_equal(image, over_triton(served, seed=12, negative_prompt="blurry")[0])


def test_n_images_are_the_seeds_in_turn(served):
    result = served.client().images.generate(model=served.entry, prompt=PROMPT, n=3,
                                             extra_body={"seed": 5, "num_inference_steps": 2})
    assert [item.seed for item in result.data] == [5, 6, 7]  # the API's extension: each image's seed
    for offset, item in enumerate(result.data):
        assert np.array_equal(decoded(item), over_triton(served, seed=5 + offset, steps=2)[0])
    assert result.size == f"{SIZE}x{SIZE}"


def test_edits_run_img2img_and_inpaint(served):
    rng = np.random.default_rng(0)
    photo = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    client = served.client()
    result = client.images.edit(model=served.entry, image=("photo.png", png(photo), "image/png"), prompt=PROMPT,
                                extra_body={"seed": 3, "num_inference_steps": 4, "strength": 0.5})
    assert np.array_equal(decoded(result.data[0]), over_triton(served, seed=3, steps=4, init_image=photo,
                                                               strength=0.5)[0])
    mask = np.full((SIZE, SIZE, 4), 255, np.uint8)
    mask[16:48, 16:48, 3] = 0  # transparent: repaint
    result = client.images.edit(model=served.entry, image=("photo.png", png(photo), "image/png"),
                                mask=("mask.png", png(mask), "image/png"), prompt=PROMPT, n=2,
                                extra_body={"seed": 3, "num_inference_steps": 4})
    expected = over_triton(served, seed=3, steps=4, init_image=photo, mask=255 - mask[..., 3], num_images=2)
    assert [np.array_equal(decoded(item), image) for item, image in zip(result.data, expected)] == [True, True]


def test_a_batch_of_edits_equals_the_same_edits_online(served):
    """Batch lines of /v1/images/edits (OpenAI's JSON form, the images as data URLs) through the official client:
    each output image equals the online multipart edit of the same image, seed and size."""
    import json

    rng = np.random.default_rng(1)
    photo = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    mask = np.full((SIZE, SIZE, 4), 255, np.uint8)
    mask[16:48, 16:48, 3] = 0

    def url(array):
        return "data:image/png;base64," + base64.b64encode(png(array)).decode()

    bodies = {"img2img": {"model": served.entry, "prompt": PROMPT, "images": [{"image_url": url(photo)}], "seed": 3,
                          "num_inference_steps": 4, "strength": 0.5, "size": f"{SIZE}x{SIZE}"},
              "inpaint": {"model": served.entry, "prompt": PROMPT, "images": [{"image_url": url(photo)}], "seed": 4,
                          "num_inference_steps": 4, "mask": {"image_url": url(mask)}, "n": 2}}
    lines = "".join(json.dumps({"custom_id": key, "method": "POST", "url": "/v1/images/edits", "body": body}) + "\n"
                    for key, body in bodies.items())
    client = served.client()
    upload = client.files.create(file=("edits.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/images/edits", completion_window="24h")
    end = time.monotonic() + HANG_GUARD_S
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < end:
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    output = {record["custom_id"]: record["response"]["body"]["data"] for record in map(
        json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    for key, body in bodies.items():
        files = {"mask": ("mask.png", png(mask), "image/png")} if "mask" in body else {}
        online = client.images.edit(model=served.entry, image=("photo.png", png(photo), "image/png"), prompt=PROMPT,
                                    n=body.get("n", 1), extra_body={k: body[k] for k in (
                                        "seed", "num_inference_steps", "strength", "size") if k in body}, **files)
        assert len(output[key]) == len(online.data) == body.get("n", 1)
        for item, online_item in zip(output[key], online.data, strict=True):
            assert np.array_equal(decoded(SimpleNamespace(**item)), decoded(online_item)), key
            assert item["seed"] == online_item.seed


def test_models_are_listed(served):
    client = served.client()
    assert [m.id for m in client.models.list().data] == [served.entry]
    assert client.models.retrieve(served.entry).owned_by == "trt-diffusion"


def refusal(served: Served, error: type, call, *, status: int) -> str:
    with pytest.raises(error) as caught:
        call()
    assert caught.value.status_code == status
    body = caught.value.body
    assert set(body) == {"message", "type", "param", "code"}, body  # the client unwraps OpenAI's {"error": ...}
    return body["message"]


def test_every_error_path_is_refused_and_the_server_keeps_serving(served):
    import openai

    client = served.client()
    generate = client.images.generate
    cases = [
        (openai.BadRequestError, 400, lambda: generate(prompt=PROMPT, extra_body={"steps": 3}),
         "unknown field 'steps'; this endpoint takes model, prompt"),
        (openai.BadRequestError, 400, lambda: generate(prompt=PROMPT, response_format="url"),
         "response_format 'url' is not served: images come back inline, use response_format b64_json"),
        (openai.BadRequestError, 400, lambda: generate(prompt=PROMPT, size="1024x1024"),
         f"size 1024x1024 is not served by {served.entry}; served sizes: {SIZE}x{SIZE}"),
        (openai.BadRequestError, 400, lambda: generate(prompt=PROMPT, n=9), f"n is 9; {served.entry} makes at most 8"),
        (openai.BadRequestError, 400, lambda: generate(prompt=PROMPT, extra_body={"num_inference_steps": 0}),
         "num_inference_steps: Input should be greater than or equal to 1 (got 0)"),
        (openai.BadRequestError, 400, lambda: generate(prompt=PROMPT, extra_body={"seed": -3}), "seed:"),
        (openai.BadRequestError, 400, lambda: generate(prompt=PROMPT, extra_body={"guidance_scale": 1000}),
         "guidance_scale:"),
        (openai.BadRequestError, 400, lambda: generate(prompt=PROMPT, extra_body={"negative_prompt": 3}),
         "negative_prompt:"),
        (openai.BadRequestError, 400, lambda: generate(prompt=PROMPT, extra_body={"loras": [{"name": "style"}]}),
         "LORAS: unknown LoRA 'style'; this model serves: none"),  # passed through: the entry refuses it by name
        (openai.BadRequestError, 400, lambda: generate(prompt=""), "prompt: String should have at least 1"),
        (openai.NotFoundError, 404, lambda: generate(model="dall-e-3", prompt=PROMPT),
         f"model 'dall-e-3' is not served; served: {served.entry}"),
        (openai.AuthenticationError, 401, lambda: served.client(api_key="wrong").images.generate(prompt=PROMPT),
         "missing or wrong API key"),
        (openai.APIStatusError, 413, lambda: generate(prompt=PROMPT, extra_body={"negative_prompt": "x" * BODY_CAP}),
         "this server takes at most"),
        (openai.NotFoundError, 404, lambda: client.models.retrieve("nope"), "model 'nope' is not served"),
    ]
    photo = png(np.zeros((SIZE, SIZE, 3), np.uint8))
    edit = client.images.edit
    cases += [
        (openai.BadRequestError, 400, lambda: edit(image=("p.png", png(np.zeros((32, 32, 3), np.uint8))), prompt="x"),
         f"size 32x32 is not served by {served.entry}"),
        (openai.BadRequestError, 400, lambda: edit(image=("p.png", photo), prompt="x", size="32x32"),
         "size 32x32 differs from the image's 64x64: images are not resized"),
        (openai.BadRequestError, 400, lambda: edit(image=("p.png", photo), mask=("m.png", photo), prompt="x"),
         "mask has no alpha channel"),
        (openai.BadRequestError, 400, lambda: edit(image=("p.png", b"GIF89a nonsense"), prompt="x"),
         "image is not a readable image"),
        (openai.BadRequestError, 400, lambda: edit(image=("p.png", photo), prompt="x", extra_body={"strength": 2}),
         "strength: Input should be less than or equal to 1"),
        (openai.BadRequestError, 400,  # the entry's own refusal, in its words: strength 0.01 of 4 steps keeps none
         lambda: edit(image=("p.png", photo), prompt="x", extra_body={"strength": 0.01, "num_inference_steps": 4}),
         "STRENGTH 0.01 keeps no step of 4"),
    ]
    for error, status, call, words in cases:
        assert words in refusal(served, error, call, status=status)
    # still serving, and right
    result = generate(prompt=PROMPT, extra_body={"seed": 1, "num_inference_steps": 2})
    assert np.array_equal(decoded(result.data[0]), over_triton(served, seed=1, steps=2)[0])


def test_a_client_that_gives_up_cancels_its_request_in_triton(served):
    import openai

    before = served.cancelled_in_log()
    with pytest.raises(openai.APITimeoutError):
        served.client(timeout=1.0).images.generate(prompt=PROMPT, extra_body={"num_inference_steps": LONG_STEPS})
    deadline = time.monotonic() + HANG_GUARD_S
    while served.cancelled_in_log() == before:  # the entry stopped the loop: its instance is free again
        assert time.monotonic() < deadline, served.server.log_tail(40)
        time.sleep(0.05)
    result = served.client().images.generate(prompt=PROMPT, extra_body={"seed": 2, "num_inference_steps": 2})
    assert np.array_equal(decoded(result.data[0]), over_triton(served, seed=2, steps=2)[0])


def test_a_full_queue_is_429(served):
    import openai

    # Two instances and a queue of one: of six long requests sent at once, at least three find the queue full.
    # Those accepted end when their clients give up (the cancellation above), not after 1000 steps.
    outcomes: list[object] = []
    lock = threading.Lock()

    def send(_):
        try:
            # eight images of LONG_STEPS each: a tiny model runs 1000 steps of one image within the 5 s when the
            # machine is idle, and a request that ends frees its place before the last ones arrive
            served.client(timeout=5.0).images.generate(prompt=PROMPT, n=8,
                                                       extra_body={"num_inference_steps": LONG_STEPS})
            outcome: object = "done"
        except openai.APIError as err:
            outcome = err
        with lock:
            outcomes.append(outcome)

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(send, range(6)))
    limited = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    assert len(limited) >= 3, outcomes
    assert all(o.status_code == 429 and o.body["code"] == "queue_full" for o in limited)
    assert "busy" in limited[0].body["message"] and "Exceeds maximum queue size" in limited[0].body["message"]
    # the accepted requests end as Triton cancels them, which under load can outlast the burst: until then a new
    # request is rightly refused, and retried as a 429 asks
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        try:
            result = served.client().images.generate(prompt=PROMPT, extra_body={"seed": 4, "num_inference_steps": 2})
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, served.server.log_tail(40)
            time.sleep(0.2)
    assert np.array_equal(decoded(result.data[0]), over_triton(served, seed=4, steps=2)[0])
