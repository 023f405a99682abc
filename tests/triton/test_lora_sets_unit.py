"""LORAS (issue 28): a request's LoRA set parsed, checked and put in its canonical form; every mistake named."""

from __future__ import annotations

import pytest

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.triton.lora_sets import LoraChoice, parse_cli_lora, parse_loras, to_json

SERVED = ("detail", "style")


def test_a_set_is_sorted_by_name_with_scale_zero_dropped():
    text = '[{"name": "style", "scale": 0.8}, {"name": "detail", "scale": -0.5}, {"name": "x", "scale": 0}]'
    assert parse_loras(text) == (LoraChoice("detail", -0.5), LoraChoice("style", 0.8))
    assert parse_loras('[{"name": "style"}]', SERVED) == (LoraChoice("style", 1.0),)  # scale defaults to 1


@pytest.mark.parametrize("text", [None, "", "  ", "[]", '[{"name": "style", "scale": 0}]'])
def test_absent_empty_or_all_zero_is_the_base_model(text):
    assert parse_loras(text, SERVED) == ()


def test_equal_sets_give_equal_json_whatever_the_order():
    one = parse_loras('[{"name": "style", "scale": 0.8}, {"name": "detail", "scale": 1}]')
    two = parse_loras('[{"name": "detail", "scale": 1.0}, {"name": "style", "scale": 0.8}]')
    assert to_json(one) == to_json(two) == '[{"name":"detail","scale":1.0},{"name":"style","scale":0.8}]'


@pytest.mark.parametrize("text, message", [
    ("[{", "LORAS is not valid JSON"),
    ('{"name": "style"}', "LORAS must be a JSON list"),
    ('["style"]', "LORAS[0] must be an object"),
    ('[{"name": "style", "weight": 1}]', "LORAS[0] has unknown key(s) ['weight']"),
    ('[{"scale": 1}]', "LORAS[0].name must be a non-empty string"),
    ('[{"name": "style", "scale": "high"}]', 'LORAS[0].scale must be a number, got "high"'),
    ('[{"name": "style", "scale": true}]', "LORAS[0].scale must be a number, got true"),
    ('[{"name": "style", "scale": 1e400}]', "LORAS[0].scale must be a finite number"),
    ('[{"name": "style", "scale": NaN}]', "LORAS[0].scale must be a finite number"),
    ('[{"name": "style", "scale": 1000}]', "LORAS[0].scale must be a finite number in [-100, 100]"),
    ('[{"name": "style"}, {"name": "style", "scale": 0.5}]', "LORAS names 'style' twice"),
    ('[{"name": "anime"}]', "unknown LoRA 'anime'; this model serves: detail, style"),
    ("[" + ",".join(['{"name": "style"}'] * 9) + "]", "LORAS lists 9 LoRAs (at most 8)"),
    ("x" * 5000, "LORAS has 5000 bytes (at most 4096)"),
])
def test_mistakes_are_named(text, message):
    with pytest.raises(RuntimeInputError) as err:
        parse_loras(text, SERVED)
    assert message in str(err.value)


def test_a_repository_without_loras_names_none():
    with pytest.raises(RuntimeInputError, match="unknown LoRA 'style'; this model serves: none"):
        parse_loras('[{"name": "style"}]', ())


def test_cli_form():
    assert parse_cli_lora("style") == LoraChoice("style", 1.0)
    assert parse_cli_lora("style:0.25") == LoraChoice("style", 0.25)
    for bad, message in ((":1", "expected NAME or NAME:SCALE"), ("style:abc", "'abc' is not a number"),
                         ("style:inf", "finite number")):
        with pytest.raises(RuntimeInputError, match=message):
            parse_cli_lora(bad)
