"""The model skeleton copied into a Triton repository follows no symbolic link out of the model folder
(issue 20, item 10). No engines, no server: copy_model_skeleton on a copy of the tiny model."""

from __future__ import annotations

import os
import shutil

import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.families import Family
from trt_diffusion.triton.repository import copy_model_skeleton


@pytest.fixture
def model(tiny_sd15_dir, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_sd15_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "controlnet", "lora"))
    return out


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret.env"
    path.write_text("API_KEY=hunter2\n")
    return path


def test_a_file_link_leaving_the_model_folder_is_refused(model, secret, tmp_path):
    (model / "tokenizer" / "notes.txt").symlink_to(secret)
    with pytest.raises(ServeError, match="notes.txt is a symbolic link to .*outside the model folder"):
        copy_model_skeleton(model, tmp_path / "skeleton", Family.sd15)
    assert not (tmp_path / "skeleton").exists()


def test_a_folder_link_leaving_the_model_folder_is_refused(model, secret, tmp_path):
    (model / "scheduler" / "extra").symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(ServeError, match="outside the model folder"):
        copy_model_skeleton(model, tmp_path / "skeleton", Family.sd15)


def test_a_relative_link_climbing_out_is_refused(model, secret, tmp_path):
    (model / "vae" / "notes.txt").symlink_to(os.path.relpath(secret, model / "vae"))
    with pytest.raises(ServeError, match="outside the model folder"):
        copy_model_skeleton(model, tmp_path / "skeleton", Family.sd15)


def test_a_linked_component_folder_outside_is_refused(model, tmp_path):
    elsewhere = tmp_path / "elsewhere-tokenizer"
    shutil.move(model / "tokenizer", elsewhere)
    (model / "tokenizer").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ServeError, match="outside the model folder"):
        copy_model_skeleton(model, tmp_path / "skeleton", Family.sd15)


def test_a_loop_is_refused(model, tmp_path):
    (model / "tokenizer" / "loop").symlink_to(model / "tokenizer", target_is_directory=True)
    with pytest.raises(ServeError, match="loop"):
        copy_model_skeleton(model, tmp_path / "skeleton", Family.sd15)


def test_a_link_inside_the_model_folder_is_copied_as_a_file(model, tmp_path):
    (model / "tokenizer" / "vocab-link.json").symlink_to(model / "tokenizer" / "tokenizer_config.json")
    copy_model_skeleton(model, tmp_path / "skeleton", Family.sd15)
    copied = tmp_path / "skeleton" / "tokenizer" / "vocab-link.json"
    assert not copied.is_symlink() and copied.read_bytes() == (model / "tokenizer" / "tokenizer_config.json").read_bytes()


def test_a_hugging_face_cache_snapshot_is_copied(model, tmp_path):
    """Every file of a hub snapshot is a link into the cache's blobs/: those links stay allowed."""
    cache = tmp_path / "models--org--tiny"
    snapshot = cache / "snapshots" / "0123abcd"
    blobs = cache / "blobs"
    blobs.mkdir(parents=True)
    for path in sorted(model.rglob("*")):
        target = snapshot / path.relative_to(model)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        blob = blobs / f"blob{len(list(blobs.iterdir()))}"
        shutil.copyfile(path, blob)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(os.path.relpath(blob, target.parent))
    copy_model_skeleton(snapshot, tmp_path / "skeleton", Family.sd15)
    assert (tmp_path / "skeleton" / "model_index.json").read_bytes() == (model / "model_index.json").read_bytes()
