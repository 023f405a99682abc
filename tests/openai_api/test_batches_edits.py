"""Batches of /v1/images/edits lines through the official `openai` client, against the API in front of the
stand-in Triton of tests/shared/images_stub_triton.py (whose edited image is a function of the input image, mask
and strength): an edit line's body is OpenAI's JSON form of an edit (the image and mask as data URLs); its output
equals the same edit sent online as a multipart form and as JSON, image for image; its refusals are the online
route's, word for word; its images are not copied into the job store (the line keeps where its body is in the input
file, which stays while the batch runs). Without Triton: the lines' byte spans, reading a line back, the sweep
keeping a running batch's input, the JSON form's refusals."""

from __future__ import annotations

import base64
import io
import json
import sqlite3
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from api_waits import png_pixels
from images_stub_triton import expected_image

from trt_diffusion.openai_api import batch_routes, bodies
from trt_diffusion.openai_api.errors import ApiError
from trt_diffusion.openai_api.job_store import TERMINAL, SqliteJobStore, StateError

EDITS = "/v1/images/edits"
HANG_GUARD_S = 60


def png(array: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(content: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(content).decode()


def edit_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": EDITS, "body": body}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def post_json(api, body: dict) -> tuple[int, dict]:
    """POST /v1/images/edits with a JSON body (the official client sends edits as multipart forms only)."""
    request = urllib.request.Request(f"{api.url}/images/edits", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def client(api):
    import openai

    return openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0)


def finished(openai_client, batch_id: str):
    end = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < end:
        batch = openai_client.batches.retrieve(batch_id)
        if batch.status in TERMINAL:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} is still {batch.status}")


def test_an_edits_batch_equals_the_same_edits_online(api, stub, tmp_path):
    rng = np.random.default_rng(0)
    photo, other = (rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(2))
    mask = np.full((64, 64, 4), 255, np.uint8)
    mask[16:48, 16:48, 3] = 0  # transparent: repaint
    image = {"image_url": data_url(png(photo))}
    ok = [
        edit_line("img2img", model="sd15-tiny", prompt="a harbour", images=[image], seed=3, strength=0.5,
                  num_inference_steps=2),
        edit_line("other-image", model="sd15-tiny", prompt="a harbour", images=[{"image_url": data_url(png(other))}],
                  seed=3, strength=0.5, num_inference_steps=2),  # another image, another result
        edit_line("inpaint", model="sd15-tiny", prompt="a boat", images=[image], n=2, num_inference_steps=2,
                  mask={"image_url": data_url(png(mask))}),  # no seed: drawn at submission
    ]
    bad = [  # refused by the online route, each for its own reason
        edit_line("no-image", model="sd15-tiny", prompt="a"),
        edit_line("a-url", model="sd15-tiny", prompt="a", images=[{"image_url": "https://example.com/a.png"}]),
        edit_line("a-file-id", model="sd15-tiny", prompt="a", images=[{"file_id": "file-abc"}]),
        edit_line("not-base64", model="sd15-tiny", prompt="a", images=[{"image_url": "data:image/png;base64,%%%"}]),
        edit_line("not-an-image", model="sd15-tiny", prompt="a", images=[{"image_url": data_url(b"GIF89a no")}]),
        edit_line("unserved-size", model="sd15-tiny", prompt="a",
                  images=[{"image_url": data_url(png(photo[:40, :40]))}]),
        edit_line("two-images", model="sd15-tiny", prompt="a", images=[image, image]),
        edit_line("unknown-field", model="sd15-tiny", prompt="a", images=[image], steps=2),
    ]
    openai_client = client(api)
    content = jsonl(ok + bad)
    upload = openai_client.files.create(file=("edits.jsonl", content), purpose="batch")
    batch = openai_client.batches.create(input_file_id=upload.id, endpoint=EDITS, completion_window="24h")
    assert batch.request_counts.total == len(ok + bad)
    # the store keeps each line's model, seed and place in the input file, not its images
    with sqlite3.connect(f"file:{tmp_path / 'state' / 'jobs.sqlite3'}?mode=ro", uri=True) as db:
        stored = [json.loads(row[0]) for row in db.execute("SELECT body FROM lines ORDER BY idx")]
    assert max(len(json.dumps(body)) for body in stored) < 200 < len(content) // len(stored)
    assert all(set(body) <= {"model", "seed", "input_line"} for body in stored)

    batch = finished(openai_client, batch.id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (3, 8)
    output = [json.loads(x) for x in openai_client.files.content(batch.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in openai_client.files.content(batch.error_file_id).text.splitlines()]
    assert [r["custom_id"] for r in output] == [line["custom_id"] for line in ok]
    assert [r["custom_id"] for r in errors] == [line["custom_id"] for line in bad]

    results = {}
    for line, record in zip(ok, output, strict=True):
        body, data = dict(line["body"]), record["response"]["body"]["data"]
        assert record["response"]["status_code"] == 200 and len(data) == body.get("n", 1)
        body.setdefault("seed", data[0]["seed"])  # the drawn seed, reported per image
        results[line["custom_id"]] = [png_pixels(item["b64_json"]) for item in data]
        # the same edit online, as a multipart form (the official client's images.edit) and as JSON
        extra = {k: body[k] for k in ("seed", "strength", "num_inference_steps") if k in body}
        files = {"mask": ("mask.png", png(mask), "image/png")} if "mask" in body else {}
        source = photo if line["custom_id"] != "other-image" else other
        online = openai_client.images.edit(model=body["model"], prompt=body["prompt"], n=body.get("n", 1),
                                           image=("photo.png", png(source), "image/png"), extra_body=extra, **files)
        status, answer = post_json(api, body)
        assert status == 200, answer
        as_json = answer["data"]
        for item, online_item, json_item in zip(data, online.data, as_json, strict=True):
            assert np.array_equal(png_pixels(item["b64_json"]), png_pixels(online_item.b64_json))
            assert np.array_equal(png_pixels(item["b64_json"]), png_pixels(json_item["b64_json"]))
            assert item["seed"] == online_item.seed == json_item["seed"]
        # and it is the stub's answer to that very edit: the line's own image, mask and strength reached Triton
        alpha = mask[..., 3] if "mask" in body else None
        assert np.array_equal(results[line["custom_id"]][0], expected_image(
            "sd15-tiny", body["prompt"], body["seed"], 64, 64, 2, init_image=source,
            mask=None if alpha is None else 255 - alpha, strength=body.get("strength")))
    assert not np.array_equal(results["img2img"][0], results["other-image"][0])

    for line, record in zip(bad, errors, strict=True):
        status, answer = post_json(api, line["body"])
        assert record["response"]["status_code"] == status == 400, line["custom_id"]
        assert record["response"]["body"] == answer  # the online message, word for word
    messages = {r["custom_id"]: r["response"]["body"]["error"]["message"] for r in errors}
    assert messages["no-image"].startswith('images is required: images: [{"image_url": "data:image/png;base64')
    assert "a URL to fetch (the server fetches no URLs)" in messages["a-url"]
    assert messages["a-file-id"].startswith("images[0].file_id is not served")
    assert messages["unserved-size"].startswith("size 40x40 is not served")
    assert messages["two-images"] == "one image per request: 2 were sent"
    # each ok line reached Triton once, and its online twins once each; no refused line reached it
    assert sorted(prompt for _, prompt, _ in stub.infers) == ["a boat"] * 3 + ["a harbour"] * 6


def test_an_edit_line_is_read_back_from_its_input_file(tmp_path):
    lines = [edit_line("a", prompt="x", images=[{"image_url": data_url(b"\x89PNG")}], seed=1),
             edit_line("b", prompt="y\u2028z", images=[{"image_url": data_url(b"\x89PNG 2")}], model="m")]
    content = b"\r\n" + json.dumps(lines[0]).encode() + b"\r\n\n" + json.dumps(lines[1], ensure_ascii=False).encode()
    spans = [span for _, span in batch_routes._batch_lines(content)]
    assert [json.loads(content[offset:offset + length]) for offset, length in spans] == lines
    assert batch_routes.check_batch_file(content) == lines  # edits lines are served in batches

    store = SqliteJobStore(tmp_path / "state")
    source = store.add_file("batch", "in.jsonl", content)
    stored = {"model": "m", "seed": 7, batch_routes.INPUT_LINE: {"file_id": source.id, "offset": spans[1][0],
                                                                  "length": spans[1][1]}}
    assert batch_routes.edit_line_body(store, stored) == {**lines[1]["body"], "seed": 7}
    store._file_path(source.id).write_bytes(b"x" * len(content))  # changed by hand
    with pytest.raises(StateError, match=f"the batch input file {source.id} no longer holds a request"):
        batch_routes.edit_line_body(store, stored)


def test_a_running_batch_keeps_its_input_file_past_the_file_s_expiry(tmp_path):
    now = [1000.0]
    store = SqliteJobStore(tmp_path / "state", retention_s=60, clock=lambda: now[0])
    source = store.add_file("batch", "in.jsonl", jsonl([edit_line("a", prompt="x")]))
    spare = store.add_file("batch", "spare.jsonl", jsonl([edit_line("a", prompt="x")]))
    batch = store.add_batch(EDITS, source.id, "24h", 86400, None, [("a", {"seed": 1})])
    now[0] += 120  # both files past their expiry; the batch still running
    store.sweep()
    assert store.file(source.id).id == source.id
    with pytest.raises(ApiError, match="no file"):
        store.file(spare.id)
    store.finalize(batch["id"], "cancelled")
    store.sweep()
    with pytest.raises(ApiError, match="no file"):
        store.file(source.id)


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "a", "image": "x"}, "image is the multipart form's file field; a JSON body sends images: "),
    ({"prompt": "a", "images": {"image_url": "x"}}, "images must be a list of one image"),
    ({"prompt": "a", "images": [{"image_url": "data:image/png;base64,AAAA", "detail": "high"}]},
     "images[0] must be {\"image_url\": \"data:image/png;base64,...\"}"),
    ({"prompt": "a", "images": [{"image_url": 5}]}, "images[0].image_url must be a string"),
    ({"prompt": "a", "images": [{"image_url": "data:text/plain,abc"}]}, "images[0].image_url is not a base64 data URL"),
    ({"prompt": "a", "images": [{"image_url": "data:image/png;base64,AAAA"}], "mask": {"file_id": "f"}},
     "mask.file_id is not served"),
    ({"prompt": "a", "images": [{"image_url": "data:image/png;base64,AAAA"}], "n": "2"}, "n: Input should be"),
])
def test_the_json_form_s_refusals_name_what_is_accepted(body, message):
    with pytest.raises(ApiError, match=None) as refused:
        bodies.edit_from_json(body)
    assert refused.value.status == 400 and refused.value.message.startswith(message), refused.value.message
