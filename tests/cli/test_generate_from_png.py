"""`generate --from PNG` trusts nothing the PNG's request chunk says (issue 44, finding 7): a crafted
`trt_diffusion` chunk naming `"init_image": "/any/absolute/path.png"` made the client read that file and send it
to the server, silently; wrong field types (`"steps": "many"`, `"seed": 2**70`) exited 3 with a traceback.

Now an input file the PNG names is read only when its name is relative, inside the PNG's folder and not a symlink
(else exit 1 naming the field), and every field is checked as the command's own options are (exit 1 naming it).
Fast: no server; a request that passes every check is sent to a closed port, whose refusal shows it got that far.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from trt_diffusion.cli import main

CLOSED = "127.0.0.1:9"  # the discard port: nothing listens on loopback
SIZE = 16
REQUEST = {"prompt": "a fox", "width": SIZE, "height": SIZE, "steps": 2, "guidance_scale": 7.5, "seed": 1}


def png(path, request: dict | None = None, size: int = SIZE):
    info = PngImagePlugin.PngInfo()
    if request is not None:
        info.add_text("trt_diffusion", json.dumps(request))
    Image.fromarray(np.full((size, size, 3), 128, np.uint8)).save(path, pnginfo=info)
    return path


def run(capsys, *args) -> tuple[int, str]:
    code = main(["generate", "--url", CLOSED, "--timeout", "5", *map(str, args)])
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def test_an_absolute_input_path_is_refused_and_not_read(tmp_path, capsys):
    elsewhere = tmp_path / "private"
    elsewhere.mkdir()
    secret = png(elsewhere / "secret.png")
    shared = tmp_path / "shared"
    shared.mkdir()
    crafted = png(shared / "crafted.png", {**REQUEST, "workflow": "img2img", "init_image": str(secret)})
    code, text = run(capsys, "--from", crafted, "-o", tmp_path / "out.png")
    assert code == 1, text
    assert "init_image" in text and "is an absolute path" in text and "Traceback" not in text
    assert "cannot reach Triton" not in text  # refused before any request


@pytest.mark.parametrize("field", ["init_image", "mask"])
def test_a_path_leaving_the_pngs_folder_is_refused(tmp_path, capsys, field):
    png(tmp_path / "secret.png")
    shared = tmp_path / "shared"
    shared.mkdir()
    png(shared / "photo.png")
    recorded = {"init_image": "photo.png", field: "../secret.png"}
    crafted = png(shared / "crafted.png", {**REQUEST, "workflow": "inpaint", **recorded})
    code, text = run(capsys, "--from", crafted, "-o", tmp_path / "out.png")
    assert code == 1, text
    assert field in text and "is outside the PNG's folder" in text and "cannot reach Triton" not in text


def test_a_symlink_beside_the_png_is_refused(tmp_path, capsys):
    secret = png(tmp_path / "secret.png")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.symlink(secret, shared / "photo.png")
    crafted = png(shared / "crafted.png", {**REQUEST, "workflow": "img2img", "init_image": "photo.png"})
    code, text = run(capsys, "--from", crafted, "-o", tmp_path / "out.png")
    assert code == 1, text
    assert "init_image" in text and "is a symlink" in text and "cannot reach Triton" not in text


def test_a_file_beside_the_png_is_used(tmp_path, capsys, monkeypatch):
    """Relative to the PNG's folder, not to where the command runs."""
    shared = tmp_path / "shared"
    (shared / "inputs").mkdir(parents=True)
    png(shared / "inputs" / "photo.png")
    crafted = png(shared / "crafted.png", {**REQUEST, "workflow": "img2img", "init_image": "inputs/photo.png"})
    monkeypatch.chdir(tmp_path)
    code, text = run(capsys, "--from", crafted, "-o", tmp_path / "out.png")
    assert code == 1 and "cannot reach Triton" in text, text  # every check passed: the request went out


def test_the_image_generate_writes_records_its_input_so_that_from_can_read_it(tmp_path):
    from trt_diffusion.cli.serve_commands import _workflow_record

    (tmp_path / "inputs").mkdir()
    image = png(tmp_path / "inputs" / "photo.png")
    record = _workflow_record("img2img", 0.5, image, None, tmp_path / "out.png")
    assert record["init_image"] == os.path.join("inputs", "photo.png")


BAD_FIELDS = {
    "steps text": ({"steps": "many"}, "steps"),
    "steps 0": ({"steps": 0}, "steps"),
    "seed 2**70": ({"seed": 2**70}, "seed"),
    "seed negative": ({"seed": -1}, "seed"),
    "seed float": ({"seed": 1.5}, "seed"),
    "width text": ({"width": "wide"}, "width"),
    "height 2**40": ({"height": 2**40}, "height"),
    "guidance NaN": ({"guidance_scale": float("nan")}, "guidance_scale"),
    "guidance text": ({"guidance_scale": "high"}, "guidance_scale"),
    "strength list": ({"strength": [1]}, "strength"),
    "prompt number": ({"prompt": 5}, "prompt"),
    "scheduler object": ({"scheduler": {"a": 1}}, "scheduler"),
    "init_image number": ({"init_image": 3}, "init_image"),
    "steps true": ({"steps": True}, "steps"),
}


@pytest.mark.parametrize("change, field", BAD_FIELDS.values(), ids=BAD_FIELDS)
def test_a_field_of_the_wrong_type_or_range_is_one_message(tmp_path, capsys, change, field):
    crafted = png(tmp_path / "crafted.png", {**REQUEST, **change})
    code, text = run(capsys, "--from", crafted, "-o", tmp_path / "out.png")
    assert code == 1, text
    assert f"'trt_diffusion' text chunk: {field} " in text and "Traceback" not in text


def test_an_a1111_seed_out_of_range_is_one_message(tmp_path, capsys):
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", f"a fox\nSteps: 2, Sampler: default, CFG scale: 7, Seed: {2**70}, Size: 16x16")
    path = tmp_path / "webui.png"
    Image.fromarray(np.zeros((SIZE, SIZE, 3), np.uint8)).save(path, pnginfo=info)
    code, text = run(capsys, "--from", path, "-o", tmp_path / "out.png")
    assert code == 1 and "seed" in text and "Traceback" not in text, text


def test_the_command_lines_own_seed_is_bounded_too(tmp_path, capsys):
    code, text = run(capsys, "--prompt", "x", "--height", "64", "--width", "64", "--seed", 2**70,
                     "-o", tmp_path / "out.png")
    assert code in (1, 2) and "--seed" in text and "Traceback" not in text, text
    code, text = run(capsys, "--prompt", "x", "--height", "64", "--width", "64", "--seed", 2**63 - 1,
                     "--num-images", "2", "-o", tmp_path / "out.png")
    assert code == 1 and "--seed" in text and "cannot reach Triton" not in text, text
