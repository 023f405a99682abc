"""Parity's prompt-following gate (issue 43): applies only to a folder that declares the synthetic world, passes an
engine that draws what its reference draws, and fails one that does not, naming the aspect."""

from __future__ import annotations

import json

from trt_diffusion import synthetic_world as world
from trt_diffusion.models.micro import TRAINING_RECORD, VOCABULARY
from trt_diffusion.parity.prompt_gate import judge_prompt_following, parity_prompts
from trt_diffusion.parity.stage import DEFAULT_PROMPTS


def _drawn(prompts, recolour=None):
    images = []
    for i, prompt in enumerate(prompts):
        scene = world.parse_caption(prompt)
        colour = recolour(scene) if recolour else scene.colour
        images.append(world.draw(world.Scene(scene.shape, colour, scene.background, 32, 32, 10 + i % 6)))
    return images


def test_the_gate_applies_to_declared_folders_only(tmp_path):
    prompts = world.prompt_grid()
    assert parity_prompts(tmp_path, DEFAULT_PROMPTS) == DEFAULT_PROMPTS
    assert judge_prompt_following(tmp_path, prompts, _drawn(prompts), _drawn(prompts)) == (None, [])
    (tmp_path / TRAINING_RECORD).write_text(json.dumps({"vocabulary": VOCABULARY}))
    assert parity_prompts(tmp_path, DEFAULT_PROMPTS) == tuple(prompts)
    following, failures = judge_prompt_following(tmp_path, prompts, _drawn(prompts), _drawn(prompts))
    assert failures == [] and following.engine == following.reference and following.reference["shape"] == 100.0
    # prompts outside the world: not applicable even for a declared folder
    assert judge_prompt_following(tmp_path, ["a lighthouse"], _drawn(prompts[:1]), _drawn(prompts[:1])) == (None, [])


def test_an_engine_that_loses_a_colour_fails_on_that_aspect(tmp_path):
    (tmp_path / TRAINING_RECORD).write_text(json.dumps({"vocabulary": VOCABULARY}))
    prompts = world.prompt_grid()
    names = list(world.PALETTE)

    def wrong_red(scene):  # the engine draws every red shape in the next palette colour that is not the background
        if scene.colour != "red":
            return scene.colour
        return next(n for n in names if n not in ("red", scene.background))

    following, failures = judge_prompt_following(tmp_path, prompts, _drawn(prompts), _drawn(prompts, wrong_red))
    assert following.engine["colour"] < following.reference["colour"] - 5
    assert len(failures) == 1 and failures[0].startswith("prompt following: colour")
