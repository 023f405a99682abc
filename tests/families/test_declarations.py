"""Each family is one declaration (trt_diffusion/families/<name>.py), registered once: what it names lazily
(its denoise loop, its reference pipeline) exists, and the tables other modules read are views of it."""

from __future__ import annotations

import importlib

import pytest

from trt_diffusion.families import FAMILIES, Family, family_info
from trt_diffusion.step_cache import StepCacheMethod, method_families
from trt_diffusion.workflows import FAMILY_WORKFLOWS, Workflow


def test_every_family_has_its_own_declaration_module():
    for family in Family:
        module = importlib.import_module(f"trt_diffusion.families.{family.value}")
        assert module.DECLARATION is family_info(family)


@pytest.mark.parametrize("family", list(Family), ids=str)
def test_the_loop_a_family_names_is_importable(family):
    loop = family_info(family).loop
    if loop is None:
        return  # the UNet/SD3 loop of runtime/pipeline.py
    module, _, name = loop.partition(":")
    assert isinstance(getattr(importlib.import_module(module), name), type), loop


@pytest.mark.parametrize("family", list(Family), ids=str)
def test_the_reference_pipeline_is_a_diffusers_class(family):
    import diffusers

    info = family_info(family)
    assert info.reference_pipeline is not None
    for name in info.pipeline_classes:
        assert hasattr(diffusers, name), name


@pytest.mark.parametrize("family", list(Family), ids=str)
def test_declared_fields_are_consistent(family):
    info = family_info(family)
    assert info.denoiser in info.components and set(info.default_components) <= set(info.components)
    assert set(info.default_precision) <= set(info.components)
    assert set(info.lora_text_encoders) <= {c for c in info.components if c.is_text_encoder}
    assert {Workflow(w) for w in info.workflows} == set(FAMILY_WORKFLOWS[family])
    assert (info.edit is not None) == (Workflow.edit.value in info.workflows)
    assert info.text_layers is None or info.language_model_encoder
    assert info.language_model_encoder == (info.encoder_tokens is not None)  # how its encoder is calibrated
    for method in info.step_cache:
        assert family in method_families(StepCacheMethod(method))


def test_the_registry_holds_every_family_once():
    assert list(FAMILIES) == list(Family)
    assert len({id(info) for info in FAMILIES.values()}) == len(Family)
