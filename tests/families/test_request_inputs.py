"""The request inputs a family adds are its declaration's (`FamilyInfo.request_inputs`, issue #42): each is an
argument of the family's reference pipeline's `__call__` with diffusers' own default, so a request that leaves it
out runs what diffusers runs; Z-Image declares cfg_normalization and cfg_truncation."""

from __future__ import annotations

import inspect

import diffusers
import pytest

from trt_diffusion.families import FAMILIES, Family, family_info, request_inputs_of_all


def _declared():
    return [(family, declared) for family, info in FAMILIES.items() for declared in info.request_inputs]


def test_z_image_declares_its_cfg_arguments():
    declared = {d.argument: d for d in family_info(Family.z_image).request_inputs}
    assert set(declared) == {"cfg_normalization", "cfg_truncation"}
    assert (declared["cfg_normalization"].name, declared["cfg_normalization"].default) == ("CFG_NORMALIZATION", 0.0)
    assert (declared["cfg_truncation"].name, declared["cfg_truncation"].default) == ("CFG_TRUNCATION", 1.0)
    assert all(d.data_type is float and d.triton_type == "TYPE_FP32" for d in declared.values())


@pytest.mark.parametrize(("family", "declared"), _declared(), ids=lambda v: getattr(v, "argument", str(v)))
def test_each_is_its_reference_pipelines_argument_at_its_default(family, declared):
    pipeline = getattr(diffusers, family_info(family).reference_pipeline)
    parameter = inspect.signature(pipeline.__call__).parameters.get(declared.argument)
    assert parameter is not None, f"{pipeline.__name__}.__call__ has no {declared.argument}"
    assert float(parameter.default) == declared.default  # diffusers' False is 0 (off)
    assert declared.problem(declared.default) is None
    assert declared.name == declared.argument.upper()


def test_one_table_of_every_familys_inputs():
    table = request_inputs_of_all()
    assert set(table) == {d.argument for _, d in _declared()}
    assert {"cfg_normalization", "cfg_truncation"} <= set(table)


@pytest.mark.parametrize(("value", "words"), [
    (-0.5, r"CFG_TRUNCATION must be in \[0, 100\], got -0.5"),
    (float("nan"), "CFG_TRUNCATION must be finite"),
    ("half", "CFG_TRUNCATION must be a number"),
])
def test_a_bad_value_is_refused_naming_the_input(value, words):
    import re

    declared = {d.argument: d for d in family_info(Family.z_image).request_inputs}["cfg_truncation"]
    assert re.search(words, declared.problem(value))
