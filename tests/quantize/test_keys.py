"""What the calibration hash and the artifact key depend on (no model is run)."""

from __future__ import annotations

import pytest

from trt_diffusion.errors import QuantizeError
from trt_diffusion.quantize.stage import plan_variant

from .conftest import model_entry, resolved


@pytest.fixture
def plan_of(tiny_model_factory, write_config):
    sd15 = tiny_model_factory("sd15")

    def plan(precision: str = "int8", config_name: str = "engines.yaml", **extra):
        path = write_config({"m": model_entry(sd15, "sd15", precision, **extra)}, config_name)
        model = resolved(path, "m")
        return plan_variant(model, "unet", precision, None, config_root=path.parent)

    return plan


def test_same_settings_same_keys(plan_of):
    first, second = plan_of(), plan_of(config_name="other.yaml")
    assert first.calibration_hash == second.calibration_hash
    assert first.input_hash == second.input_hash
    assert first.recipe.prompts == second.recipe.prompts  # the bundled set, in order
    assert first.recipe.seeds() == [0, 1]


@pytest.mark.parametrize("change", [
    {"calibration": {"seed": 1}},
    {"calibration": {"samples": 3}},
    {"calibration": {"steps": 3}},
    {"calibration": {"algorithm": "smoothquant"}},
    {"quantization": {"exclude": ["*attn2*"]}},
])
def test_calibration_inputs_change_both_keys(plan_of, change):
    base, changed = plan_of(), plan_of(**change)
    assert changed.calibration_hash != base.calibration_hash
    assert changed.input_hash != base.input_hash


def test_a_prompt_file_replaces_the_bundled_set_and_its_content_is_keyed(plan_of, tmp_path):
    (tmp_path / "prompts.txt").write_text("# comment\na red bicycle\n\na blue boat\n")
    custom = plan_of(calibration={"prompts": "prompts.txt"})
    assert custom.recipe.prompts == ("a red bicycle", "a blue boat")
    assert custom.calibration_hash != plan_of().calibration_hash
    (tmp_path / "prompts.txt").write_text("a red bicycle\na green boat\n")
    assert plan_of(calibration={"prompts": "prompts.txt"}).calibration_hash != custom.calibration_hash


def test_export_settings_change_the_key_but_not_the_calibration(plan_of, tiny_model_factory, write_config):
    base = plan_of()
    path = write_config({"m": model_entry(tiny_model_factory("sd15"), "sd15", "int8")}, "opset.yaml")
    other = plan_variant(resolved(path, "m"), "unet", "int8", None, opset=19)
    assert other.calibration_hash == base.calibration_hash
    assert other.input_hash != base.input_hash


def test_precision_changes_both(plan_of):
    assert plan_of("fp8").calibration_hash != plan_of("int8").calibration_hash


def test_unsupported_requests_are_clear_errors(plan_of, tiny_model_factory, write_config):
    with pytest.raises(QuantizeError, match="smoothquant.*int8 only"):
        from trt_diffusion.quantize.exclusions import LayerSelection
        from trt_diffusion.quantize.ptq import quantize_config

        quantize_config("fp8", "smoothquant", LayerSelection((), {}, ()))
    path = write_config({"m": model_entry(tiny_model_factory("sd15"), "sd15", "int8")}, "te.yaml")
    with pytest.raises(QuantizeError, match="text_encoder is not supported yet"):
        plan_variant(resolved(path, "m"), "text_encoder", "int8", None)
    with pytest.raises(QuantizeError, match="cannot be read"):
        plan_of(calibration={"prompts": "missing.txt"})


def test_a_unet_with_controlnets_is_calibrated_with_them_and_their_weights_are_keyed(tiny_model_factory,
                                                                                    write_config):
    """A UNet whose engines take ControlNet residuals: the recipe names the ControlNet folders (its odd prompts run
    through them, quantize/calibration.py) and their weights are in the calibration hash; without a ControlNet the
    recipe, and so every existing key, is what it was."""
    folder = tiny_model_factory("sd15", controlnet=True)

    def plan(name: str, **extra):
        path = write_config({"m": model_entry(folder, "sd15", "int8", **extra)}, name)
        return plan_variant(resolved(path, "m"), "unet", "int8", None, config_root=path.parent)

    plain = plan("plain.yaml")
    controlled = plan("control.yaml", controlnets={"canny": {"source": str(folder / "controlnet")}})
    assert plain.recipe.controlnets == () and "controlnets" not in plain.recipe.to_json()
    assert controlled.recipe.controlnets == (str((folder / "controlnet").resolve()),)
    assert controlled.calibration_inputs["controlnets"] and "controlnets" not in plain.calibration_inputs
    assert controlled.calibration_hash != plain.calibration_hash
