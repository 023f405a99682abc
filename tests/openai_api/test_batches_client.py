"""The Batch API through the official `openai` client, unmodified, against the API in front of a stand-in Triton
whose images are a function of the request (tests/shared/images_stub_triton.py): a batch of 40 lines over two
models and LoRA sets, some invalid, equals the same 40 requests sent online image for image, and its invalid lines
carry the online messages; cancel stops the running line; each bad input is one clear error; with --api-key the
jobs need the key; nothing is written outside the state folder."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from api_waits import png_pixels
from images_stub_triton import expected_image

from trt_diffusion.openai_api.server import ApiServer
from trt_diffusion.openai_api.settings import ApiSettings

KEY = "batch-key"
CAP = 256 * 1024
HANG_GUARD_S = 60  # a batch that never finishes fails the test instead of hanging it


@pytest.fixture
def api_settings() -> dict:
    """`api` (tests/openai_api/conftest.py) with a key, a small body cap and a small quota."""
    return {"api_key": KEY, "max_body_bytes": CAP, "state_max_bytes": 2 * 1024 * 1024}


def client(api, key=KEY):
    import openai

    return openai.OpenAI(base_url=api.url, api_key=key, max_retries=0)


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def request_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/images/generations", "body": body}


def finished(openai_client, batch_id: str):
    end = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < end:
        batch = openai_client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} is still {batch.status}")


def forty_lines() -> list[dict]:
    lines = []
    for i in range(34):
        body = {"model": "sd15-tiny" if i % 2 else "sdxl-tiny", "prompt": f"poster {i}", "num_inference_steps": 2}
        if i % 3 == 0:
            body["seed"] = 1000 + i
        if i % 5 == 0:  # no seed: one is drawn at submission and reported per image
            body.pop("seed", None)
        if i % 4 == 1:
            body["loras"] = [{"name": "style", "scale": 0.5 + i / 100}]
        if i % 7 == 0:
            body["n"] = 2
        lines.append(request_line(f"ok-{i}", **body))
    lines += [  # refused by the online route, each for its own reason
        request_line("bad-field", model="sd15-tiny", prompt="a", steps=4),
        request_line("bad-size", model="sdxl-tiny", prompt="a", size="32x48"),
        request_line("bad-model", model="nope", prompt="a"),
        request_line("bad-n", model="sd15-tiny", prompt="a", n=9),
        request_line("bad-loras", model="sd15-tiny", prompt="a", loras=[{"name": "", "scale": 1}]),
        request_line("bad-prompt", model="sd15-tiny", prompt=""),
    ]
    return lines


def test_a_batch_of_40_equals_the_same_requests_online(api, stub, tmp_path):
    openai_client = client(api)
    lines = forty_lines()
    upload = openai_client.files.create(file=("posters.jsonl", jsonl(lines)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == len(jsonl(lines))
    batch = openai_client.batches.create(input_file_id=upload.id, endpoint="/v1/images/generations",
                                         completion_window="24h", metadata={"project": "posters"})
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 40
    batch = finished(openai_client, batch.id)
    assert batch.status == "completed" and batch.metadata == {"project": "posters"}
    assert (batch.request_counts.completed, batch.request_counts.failed) == (34, 6)
    output = [json.loads(x) for x in openai_client.files.content(batch.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in openai_client.files.content(batch.error_file_id).content.splitlines()]
    assert [record["custom_id"] for record in output] == [line["custom_id"] for line in lines[:34]]
    assert [record["custom_id"] for record in errors] == [line["custom_id"] for line in lines[34:]]

    for line, record in zip(lines[:34], output, strict=True):
        assert record["response"]["status_code"] == 200 and record["error"] is None
        body = dict(line["body"])
        data = record["response"]["body"]["data"]
        assert len(data) == body.get("n", 1)
        if "seed" in body:
            assert data[0]["seed"] == body["seed"]
        body["seed"] = data[0]["seed"]  # a drawn seed: the online request sends the one the batch stored
        online = openai_client.images.generate(**{k: v for k, v in body.items() if k in ("model", "prompt", "n")},
                                               extra_body={k: v for k, v in body.items()
                                                           if k not in ("model", "prompt", "n")})
        for item, online_item in zip(data, online.data, strict=True):
            image = png_pixels(item["b64_json"])
            assert np.array_equal(image, png_pixels(online_item.b64_json))
            assert item["seed"] == online_item.seed
        # and the image is the stub's answer to that very request, the LoRA set included
        plain = expected_image(body["model"], body["prompt"], body["seed"], 64, 64, 2)
        assert np.array_equal(png_pixels(data[0]["b64_json"]), plain) == ("loras" not in body)

    import openai

    for line, record in zip(lines[34:], errors, strict=True):
        body = dict(line["body"])
        with pytest.raises(openai.APIStatusError) as online:
            openai_client.images.generate(**{k: v for k, v in body.items() if k in ("model", "prompt", "n")},
                                          extra_body={k: v for k, v in body.items()
                                                      if k not in ("model", "prompt", "n")})
        assert record["response"]["status_code"] == online.value.status_code
        assert record["response"]["body"] == {"error": online.value.body}  # the online message, word for word
    # each ok line was inferred once: the batch never ran a line twice
    assert len([i for i in stub.infers if i[1].startswith("poster")]) == 2 * 34

    state = tmp_path / "state"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]  # nothing written beside the state folder
    assert not any((state / "results").iterdir())  # finished batches keep their results in the files only


def test_cancel_stops_the_running_line_and_frees_triton(api, stub):
    import threading


    stub.gate = threading.Semaphore(0)
    openai_client = client(api)
    upload = openai_client.files.create(file=("a.jsonl", jsonl([request_line(f"r{i}", model="sd15-tiny", prompt="x", seed=i)
                                                               for i in range(3)])), purpose="batch")
    batch = openai_client.batches.create(input_file_id=upload.id, endpoint="/v1/images/generations",
                                         completion_window="24h")
    assert stub.entered.wait(HANG_GUARD_S)  # the first line is inside Triton
    assert openai_client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = finished(openai_client, batch.id)
    assert batch.status == "cancelled" and batch.output_file_id is None
    assert stub.cancelled.wait(HANG_GUARD_S)  # the held call was cancelled in Triton, not left in its queue
    stub.gate.release(10)
    assert stub.infers == []  # and no other line started
    listed = openai_client.batches.list()
    assert [b.id for b in listed.data] == [batch.id] and listed.data[0].status == "cancelled"
    assert openai_client.batches.cancel(batch.id).status == "cancelled"  # cancelling again answers the batch


def test_bad_input_is_one_clear_error_each(api, stub, tmp_path):
    import openai

    openai_client = client(api)
    good = request_line("a", model="sd15-tiny", prompt="x")
    with pytest.raises(openai.BadRequestError, match=r"line 2 of the file is not JSON"):
        openai_client.files.create(file=("b.jsonl", jsonl([good]) + b'{"custom_id": \n'), purpose="batch")
    with pytest.raises(openai.BadRequestError, match=r"line 1 of the file: url '/v1/chat/completions' is not "
                                                     r"served in batches; served: /v1/images/generations"):
        openai_client.files.create(file=("b.jsonl", jsonl([good | {"url": "/v1/chat/completions"}])),
                                   purpose="batch")
    with pytest.raises(openai.BadRequestError, match=r"line 2 of the file: custom_id 'a' is used twice"):
        openai_client.files.create(file=("b.jsonl", jsonl([good, good])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose 'fine-tune' is not served"):
        openai_client.files.create(file=("b.jsonl", jsonl([good])), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError, match=f"this server takes at most {CAP} bytes") as too_big:
        openai_client.files.create(file=("b.jsonl", jsonl([good]) * (CAP // 60)), purpose="batch")
    assert too_big.value.status_code == 413
    upload = openai_client.files.create(file=("b.jsonl", jsonl([good])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint '/v1/chat/completions' is not served in batches"):
        openai_client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window must be hours like '24h'"):
        openai_client.batches.create(input_file_id=upload.id, endpoint="/v1/images/generations",
                                     completion_window="soon")
    for call in (lambda: openai_client.batches.retrieve("batch-nope"),
                 lambda: openai_client.batches.cancel("batch-nope"),
                 lambda: openai_client.files.retrieve("file-nope"),
                 lambda: openai_client.files.content("file-nope"),
                 lambda: openai_client.batches.create(input_file_id="file-nope", endpoint="/v1/images/generations",
                                                      completion_window="24h")):
        with pytest.raises(openai.NotFoundError, match="(no batch|no file) '(batch|file)-nope'"):
            call()
    # the quota (2 MiB here): uploads that do not fit are refused, naming the option
    big = jsonl([request_line(f"q{i}", prompt="x" * 3000) for i in range(80)])
    with pytest.raises(openai.APIStatusError, match=r"does not fit in the job store: .* \(--state-max-gb\)") as full:
        for _ in range(20):
            openai_client.files.create(file=("big.jsonl", big), purpose="batch")
    assert full.value.status_code == 413 and full.value.body["code"] == "state_quota_exceeded"
    assert openai_client.files.retrieve(upload.id).id == upload.id  # the server serves on after each refusal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
    assert not [p for p in (tmp_path / "state" / "files").iterdir() if p.name.startswith(".")]  # no temporaries


def test_jobs_need_the_key(api):
    import openai

    with pytest.raises(openai.AuthenticationError):
        client(api, key="wrong").batches.list()
    with pytest.raises(openai.AuthenticationError):
        client(api, key="wrong").files.create(file=("a.jsonl", b"{}\n"), purpose="batch")


def test_without_a_state_folder_jobs_are_off(stub):
    import openai

    with ApiServer(ApiSettings(stub.url, port=0)) as server, pytest.raises(
            openai.NotFoundError, match=r"jobs are off: .* \(--state-dir\)"):
        client(server).batches.list()
