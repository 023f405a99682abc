"""The runtime reads a model folder's model_index.json through the same allow-list as loading and export (issue
44, finding 8): before, `EnginePipeline` read it with a bare json.loads and a Wan image-to-video folder's
`image_processor` entry was imported whatever module it named."""

from __future__ import annotations

import json
import sys

import pytest

from trt_diffusion.errors import ModelError


def _planted_module(tmp_path, monkeypatch, name: str):
    """A module on sys.path that leaves a file behind when imported: the proof that it ran."""
    marker = tmp_path / f"{name}.ran"
    (tmp_path / f"{name}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "class Anything:\n    @classmethod\n    def from_pretrained(cls, *a, **k):\n        return cls()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return marker


def test_the_pipeline_refuses_a_model_index_naming_another_module(tmp_path, monkeypatch):
    from trt_diffusion.runtime.engines import RunnerTable
    from trt_diffusion.runtime.pipeline import EnginePipeline

    folder = tmp_path / "wan-i2v"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "WanImageToVideoPipeline", "image_processor": ["planted_module_44", "Anything"]}))
    # the refusal comes from the index itself, before any other file of the folder is read
    with pytest.raises(ModelError, match=r"image_processor names \['planted_module_44', 'Anything'\]; only "
                                         r"diffusers and transformers classes are loaded"):
        EnginePipeline(folder, "wan", RunnerTable())


def test_the_image_processor_is_imported_only_from_diffusers_or_transformers(tmp_path, monkeypatch):
    from trt_diffusion.runtime.video_conditioning import _clip_processor

    marker = _planted_module(tmp_path, monkeypatch, "planted_module_44b")
    folder = tmp_path / "wan-i2v"
    (folder / "image_processor").mkdir(parents=True)
    with pytest.raises(ModelError, match=r"image_processor names \['planted_module_44b', 'Anything'\]"):
        _clip_processor(folder, {"image_processor": ["planted_module_44b", "Anything"]})
    assert not marker.exists()  # nothing was imported
    # a name inside an allowed library that is not a class with from_pretrained is refused too
    with pytest.raises(ModelError, match=r"image_processor names \['transformers', 'logging'\]"):
        _clip_processor(folder, {"image_processor": ["transformers", "logging"]})
