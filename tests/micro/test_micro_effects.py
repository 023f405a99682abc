"""The effect measures of micro_effects.py on drawers whose answer is known: a drawer that does what it is asked
scores full marks, one that ignores the request scores none (the measures can fail)."""

from __future__ import annotations

import numpy as np

from trt_diffusion import micro_effects as effects
from trt_diffusion import synthetic_world as world


def _asked(fields: dict, style: str = "plain") -> world.Scene:
    wanted = world.parse_caption(fields["prompt"])
    return world.Scene(wanted.shape, wanted.colour, wanted.background, 32.0, 32.0, 16.0, style)


def test_the_outlined_share_reads_the_style_drawn():
    prompts = world.prompt_grid()[:6]
    assert effects.outlined_share(lambda f: world.draw(_asked(f, "outlined")), prompts) == 100.0
    assert effects.outlined_share(lambda f: world.draw(_asked(f)), prompts) == 0.0


def test_control_overlap_follows_the_edges_or_not():
    def following(fields):  # draws the shape whose edges it was given
        scene = next(s for s in effects.control_scenes(36) if np.array_equal(world.edge_map(s), fields["control_image"]))
        return world.draw(scene)

    good = effects.control_overlap(following, "edges", count=6)
    assert good.mean_overlap > 0.9 and good.share_at_least_0_7 == 100.0
    ignoring = effects.control_overlap(lambda f: world.draw(_asked(f)), "edges", count=6)  # always centred
    assert ignoring.mean_overlap < good.mean_overlap and ignoring.share_at_least_0_7 < 100.0


def test_inpaint_reads_the_repaint_and_the_change_outside():
    def repainting(fields):  # the asked colour inside the mask's shape, the rest untouched
        wanted = world.parse_caption(fields["prompt"])
        image = fields["init_image"].copy()
        inside = fields["mask"] > 127
        shape = np.linalg.norm(image.astype(float) - world.PALETTE[wanted.background], axis=-1) > 70
        image[inside & shape] = world.PALETTE[wanted.colour]
        return image

    def shifted(image, by=2):  # a VAE whose round trip moves every pixel by two levels
        return np.clip(image.astype(int) + by, 0, 255).astype(np.uint8)

    def pasted(init, target, mask):  # ... and whose latent paste keeps the target inside, moves the outside by 4
        return np.where(mask[..., None] > 127, target, shifted(init, 4))

    floors = effects.VaeFloors(shifted, pasted)
    good = effects.inpaint_repaint(repainting, floors, count=6)
    assert good.repainted == 100.0 and good.outside_change == 0.0
    assert good.vae_round_trip_change == 2.0 and good.latent_paste_change == 4.0
    assert good.outside_within_round_trip
    unchanged = effects.inpaint_repaint(lambda f: f["init_image"], floors, count=6)
    assert unchanged.repainted == 0.0  # the old colour stays: not what the prompt asked
    smeared = effects.inpaint_repaint(lambda f: shifted(f["init_image"], 8), floors, count=6)
    assert not smeared.outside_within_round_trip
