"""Every family's minimal engines.yaml plans the engine keys and ONNX keys recorded in plan_keys.json (#42,
acceptance 2): moving a family's code must not rebuild anyone's engines. `python tests/families/plan_keys.py
--update` rewrites the record where a family's default changes on purpose."""

from __future__ import annotations

import json

import pytest

from tests.families.plan_keys import GOLDEN, family_names, minimal_engines_yaml, planned_keys


@pytest.mark.parametrize("family", family_names())
def test_minimal_engines_yaml_plans_the_recorded_keys(family, tiny_model_factory, tmp_path):
    golden = json.loads(GOLDEN.read_text())
    assert family in golden, f"{family} has no recorded keys: run tests/families/plan_keys.py --update"
    keys = planned_keys(minimal_engines_yaml(tmp_path, tiny_model_factory(family), family))
    assert keys, f"{family}: the minimal engines.yaml planned no engines"
    assert keys == golden[family]


def test_every_recorded_family_is_declared():
    assert sorted(json.loads(GOLDEN.read_text())) == sorted(family_names())
