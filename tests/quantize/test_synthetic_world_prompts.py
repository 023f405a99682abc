"""A micro-model (its folder declares the synthetic world) calibrates on that world's captions outside the
evaluation grid, and its quality gate judges on the grid's prompts: the bundled calibration prompts are words
such a model never learned, and a gate on prompts the scales were fitted to would flatter them."""

from __future__ import annotations

import json

from trt_diffusion.models.micro import TRAINING_RECORD, VOCABULARY
from trt_diffusion.quantize.calibration import CalibrationRecipe
from trt_diffusion.quantize.gate import held_out_recipe
from trt_diffusion.quantize.prompts import HELD_OUT_PROMPTS, load_prompts, take
from trt_diffusion.synthetic_world import all_captions, parse_caption, prompt_grid


def _recipe(prompts) -> CalibrationRecipe:
    return CalibrationRecipe(prompts=tuple(prompts), steps=2, seed=0, algorithm="max", width=64, height=64)


def test_a_micro_model_calibrates_on_world_captions_the_grid_does_not_ask(tmp_path):
    (tmp_path / TRAINING_RECORD).write_text(json.dumps({"vocabulary": VOCABULARY}))
    prompts, source = load_prompts(None, None, tmp_path)
    assert source == "synthetic-world"
    assert all(parse_caption(p) is not None for p in prompts)
    assert not set(prompts) & set(prompt_grid())
    assert len(prompts) == len(all_captions()) - len(prompt_grid())


def test_a_users_checkpoint_keeps_the_bundled_prompts(tmp_path):
    assert load_prompts(None, None, tmp_path)[1] == load_prompts(None)[1] == "bundled:calibration_prompts.txt"


def test_a_prompts_file_wins_over_the_world(tmp_path):
    (tmp_path / TRAINING_RECORD).write_text(json.dumps({"vocabulary": VOCABULARY}))
    (tmp_path / "mine.txt").write_text("a red circle on a blue background\n")
    assert load_prompts("mine.txt", tmp_path, tmp_path) == (["a red circle on a blue background"], "file:mine.txt")


def test_the_gate_judges_a_world_calibration_on_the_grid():
    world, _ = held_out_recipe(_recipe(take(all_captions()[:3], 3)), 4)
    assert world == prompt_grid()[:4]
    bundled, _ = held_out_recipe(_recipe(take(load_prompts(None)[0], 3)), 2)
    assert bundled == list(HELD_OUT_PROMPTS[:2])
