"""The prompt-following measure (issue 43) reads the synthetic world's own drawings exactly, and tells a wrong
picture from a right one: it is a judge that can fail."""

from __future__ import annotations

import numpy as np
import pytest

from trt_diffusion import synthetic_world as world
from trt_diffusion.prompt_following import follows, grid_figures, read_image, shape_overlap


def test_every_drawn_scene_reads_as_its_caption():
    rng = np.random.default_rng(7)
    for index in range(600):
        scene = world.random_scene(rng, style="outlined" if index % 3 == 0 else "plain")
        verdict = follows(world.draw(scene), scene.caption)
        assert verdict == {"background": True, "colour": True, "shape": True, "style": True}, scene


def test_a_wrong_picture_fails_the_aspect_it_gets_wrong():
    scene = world.Scene("circle", "red", "blue", 32, 32, 14)
    image = world.draw(scene)
    assert follows(image, "a red square on a blue background") == {
        "background": True, "colour": True, "shape": False, "style": True}
    assert follows(image, "a green circle on a blue background")["colour"] is False
    assert follows(image, "a red circle on a white background")["background"] is False
    assert follows(image, "an outlined red circle on a blue background")["style"] is False
    blank = np.full((64, 64, 3), world.PALETTE["blue"], dtype=np.uint8)
    assert read_image(blank).shape is None
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    assert not all(follows(noise, scene.caption).values())


def test_prompts_outside_the_world_are_not_applicable():
    image = world.draw(world.Scene("square", "yellow", "black", 30, 30, 12))
    assert follows(image, "a lighthouse at dusk") is None
    assert follows(image, "a red circle on a red background") is None  # not a caption the world draws
    assert grid_figures([image], ["a lighthouse at dusk"]) is None


def test_the_grid_is_fixed_and_covers_every_shape_and_colour():
    grid = world.prompt_grid()
    assert len(grid) == 36 and len(set(grid)) == 36
    parsed = [world.parse_caption(prompt) for prompt in grid]
    assert {p.shape for p in parsed} == set(world.SHAPES) and {p.colour for p in parsed} == set(world.PALETTE)
    assert all(p.colour != p.background for p in parsed)


def test_edge_maps_outline_the_shape():
    scene = world.Scene("triangle", "white", "black", 30, 34, 16)
    edges = world.edge_map(scene)[..., 0] > 0
    mask = world.shape_mask(scene)
    assert edges.any() and not (edges & ~mask).any()  # edges lie on the shape's border pixels
    assert edges.sum() < mask.sum() / 2


@pytest.mark.parametrize("text", ["a red circle on a blue background", "A Red Circle On A Blue Background "])
def test_captions_round_trip(text):
    scene = world.parse_caption(text)
    assert scene is not None and scene.caption == "a red circle on a blue background"


def test_shape_overlap_is_high_for_the_drawn_shape_and_low_for_another_place():
    """The ControlNet measure: a picture of the control scene overlaps its mask; the same shape elsewhere does not."""
    rng = np.random.default_rng(5)
    for _ in range(50):
        scene = world.random_scene(rng)
        assert shape_overlap(world.draw(scene), world.shape_mask(scene)) >= 0.85
        moved = world.Scene(scene.shape, scene.colour, scene.background, world.SIZE - scene.cx,
                            world.SIZE - scene.cy, scene.radius)
        if abs(moved.cx - scene.cx) + abs(moved.cy - scene.cy) > 2.5 * scene.radius:
            assert shape_overlap(world.draw(moved), world.shape_mask(scene)) < 0.3
