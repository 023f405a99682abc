"""One seeded ControlNet edge map (sample_inputs.control_image): parity and preflight feed the same one, so a
preflight run at parity's seed asks the engines what parity judged (they were two copies that could drift)."""

from __future__ import annotations

import numpy as np

from trt_diffusion import sample_inputs


def test_parity_and_preflight_feed_one_control_image():
    from trt_diffusion.parity import stage as parity_stage
    from trt_diffusion.preflight.checks import memory, plugins

    for module in (parity_stage, memory, plugins):
        assert module.control_image is sample_inputs.control_image, module.__name__


def test_the_control_image_is_a_seeded_edge_map():
    image = sample_inputs.control_image(32, 48, seed=3)
    assert image.shape == (32, 48, 3) and image.dtype == np.uint8
    assert set(np.unique(image)) == {0, 255}
    lit = image[..., 0] == 255
    assert lit.all(axis=1).any() and lit.all(axis=0).any()  # full-length lines, both ways
    assert np.array_equal(image, sample_inputs.control_image(32, 48, seed=3))
    assert not np.array_equal(image, sample_inputs.control_image(32, 48, seed=4))
