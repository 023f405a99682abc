"""Uploads to /v1/images/edits cost no more than the served sizes allow (issue 44, finding 5): the image's header is
read and its size checked against the served sizes before any pixel is decoded; decoding runs off the event loop,
so /health answers meanwhile; and at most `max_decodes` decodes run at once (the rest wait their turn).

Pixel decoding is observed where Pillow does it (`ImageFile.load`), over the real API and the real openai client;
Triton is the stand-in of conftest.py (no engine runs here)."""

from __future__ import annotations

import io
import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image, ImageFile

from trt_diffusion.openai_api.server import ApiServer
from trt_diffusion.openai_api.settings import ApiSettings

GUARD_S = 60  # hang guards only: nothing below measures a duration


def png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG")
    return buffer.getvalue()


class Decodes:
    """Pillow's pixel decoding, recorded; with `hold`, each decode waits until released."""

    def __init__(self, monkeypatch, hold: bool = False):
        self.calls: list[tuple[int, int]] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Event()
        self.hold = hold
        original = ImageFile.ImageFile.load

        def load(image):
            if getattr(image, "_im", None) is None:  # a first load: the pixels are decoded now
                self.calls.append(image.size)
                self.started.release()
                if self.hold:
                    assert self.release.wait(GUARD_S), "the test never released the decode"
            return original(image)

        monkeypatch.setattr(ImageFile.ImageFile, "load", load)


def client(api):
    import openai

    return openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=GUARD_S)


def health(api) -> dict:
    with urllib.request.urlopen(api.url.removesuffix("/v1") + "/health", timeout=GUARD_S / 2) as response:
        return json.loads(response.read())


def test_an_8192_square_png_is_refused_from_its_header_without_decoding(stub_triton, monkeypatch):
    import openai

    decodes = Decodes(monkeypatch)
    upload = png((8192, 8192), mode="1")  # a small file (kilobytes) that would decode to 64 M pixels
    assert len(upload) < 1 << 20
    with ApiServer(ApiSettings(stub_triton.url, port=0)) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            client(api).images.edit(model=stub_triton.entry, prompt="a fox", image=("big.png", upload, "image/png"))
    error = caught.value.body
    assert "8192x8192 is not served by sd15-tiny; served sizes: 64x64" in error["message"], error
    assert decodes.calls == []  # refused from the header alone
    assert stub_triton.calls["ModelInfer"] == 0


def test_a_mask_of_another_size_is_refused_before_decoding(stub_triton, monkeypatch):
    import openai

    decodes = Decodes(monkeypatch)
    with ApiServer(ApiSettings(stub_triton.url, port=0)) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            client(api).images.edit(model=stub_triton.entry, prompt="a fox", image=("a.png", png((64, 64)), "image/png"),
                                    mask=("m.png", png((8192, 8192), mode="1"), "image/png"))
    assert "mask is 8192x8192, the image 64x64" in caught.value.body["message"]
    assert decodes.calls == []


def test_health_answers_while_decodes_run_and_decodes_are_bounded(stub_triton, monkeypatch):
    import openai

    decodes = Decodes(monkeypatch, hold=True)
    upload = png((64, 64))
    with ApiServer(ApiSettings(stub_triton.url, port=0, max_decodes=1)) as api, ThreadPoolExecutor(2) as pool:
        def edit(_):
            try:
                client(api).images.edit(model=stub_triton.entry, prompt="a fox", image=("a.png", upload, "image/png"))
            except openai.BadRequestError as err:  # the stand-in Triton refuses inference: decoding was done
                return err.body["message"]
            return "answered"

        first = pool.submit(edit, 1)
        assert decodes.started.acquire(timeout=GUARD_S), "the first upload never started decoding"
        assert health(api)["status"] == "ok"  # the event loop is free while a decode runs
        second = pool.submit(edit, 2)
        while health(api)["decodes"]["waiting"] != 1:  # the second upload waits for the one decode slot
            assert not second.done(), second.result()
        assert health(api)["decodes"] == {"running": 1, "waiting": 1, "limit": 1}
        assert len(decodes.calls) == 1
        decodes.release.set()
        assert "stub triton: no engine here" in first.result(timeout=GUARD_S)
        assert "stub triton: no engine here" in second.result(timeout=GUARD_S)
    assert decodes.calls == [(64, 64), (64, 64)]
    assert stub_triton.calls["ModelInfer"] == 2


def _broken_chunk_png() -> bytes:
    """A 64x64 PNG whose pixel data continues in a chunk with a malformed type: its header reads, its decode makes
    Pillow raise SyntaxError ('broken PNG file'), not OSError."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    buffer = io.BytesIO()
    Image.effect_noise((64, 64), 64).convert("RGB").save(buffer, format="PNG")
    data, out, position = buffer.getvalue(), buffer.getvalue()[:8], 8
    while position < len(data):
        (length,) = struct.unpack(">I", data[position:position + 4])
        kind, body = data[position + 4:position + 8], data[position + 8:position + 8 + length]
        position += 12 + length
        half = len(body) // 2
        out += chunk(kind, body) if kind != b"IDAT" else chunk(b"IDAT", body[:half]) + chunk(b"\x01\x02\x03\x04",
                                                                                             body[half:])
    return out


def test_an_upload_pillow_finds_broken_while_decoding_is_a_400_not_an_internal_error(stub_triton):
    import openai

    with ApiServer(ApiSettings(stub_triton.url, port=0)) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            client(api).images.edit(model=stub_triton.entry, prompt="a fox",
                                    image=("broken.png", _broken_chunk_png(), "image/png"))
    assert "image is not a readable image" in caught.value.body["message"], caught.value.body
    assert stub_triton.calls["ModelInfer"] == 0
