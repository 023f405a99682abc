"""LoRA per request (issue 28) in the engine runners: LoraSwitchingRunner over real onnxruntime and openvino engines,
with the parts `package` writes (triton/lora_parts.py). A set equals the in-process refit of the same LoRAs and
scales; A -> B -> A and back to base are bit-exact; the LRU keeps what it should."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from trt_diffusion.targets import get_target
from trt_diffusion.targets.lora_switch import FOLDER, LoraParts, LoraSwitchingRunner

REFIT_TOLERANCE = 1e-5  # base + scale * delta against W + scale * up @ down * alpha / rank: float32 rounding only


def _unet(config_path: Path, target: str):
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import built_engines

    config = load_engines_file(config_path, check_sources=True)
    (name,) = config.models
    engines = built_engines(config, name, target)
    (unet,) = [e for e in engines if e.spec.component == "unet" and e.spec.refittable]
    return config, name, engines, unet


def _served_folder(tmp: Path, engine, parts) -> Path:
    """What `package` puts in an engine model's version folder: the engine's files and `loras/`."""
    folder = tmp / "version"
    shutil.copytree(engine.path, folder)  # engine folders refuse links
    shutil.copytree(parts["unet"].folder, folder / FOLDER)
    return folder


def _feeds(runner, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal([d if isinstance(d, int) else 1 for d in spec.shape]) * 10).astype(spec.dtype)
            for name, spec in runner.inputs.items()}


def _reference(config, name, engine, target, loras) -> np.ndarray:
    """The in-process refit of `loras` ((path, scale), ...): what `trt-diffusion refit` applies."""
    from trt_diffusion.runtime.loader import refit_weights

    weights = refit_weights(config, name, loras, refittable={"unet"})["unet"]
    return get_target(target).runner(engine, weights)


def _switching(config, name, engines, unet, target, tmp_path, capacity=4):
    from trt_diffusion.triton.lora_parts import write_parts

    parts = write_parts(config, name, engines, tmp_path / "parts")
    folder = _served_folder(tmp_path, unet, parts)
    chosen = get_target(target)
    base = chosen.runner_from_files(folder, unet.spec.name)
    return LoraSwitchingRunner(base, LoraParts.read(folder),
                               lambda weights: chosen.lora_runner(folder, unet.spec.name, weights, base=base),
                               capacity=capacity)


def _output(runner, feeds) -> np.ndarray:
    (value,) = runner.run(feeds).values()
    return value


def test_onnxruntime_sets_equal_the_refit_and_switch_back_exactly(built_sd15_two_loras, tmp_path):
    config, name, engines, unet = _unet(built_sd15_two_loras, "onnxruntime")
    loras = config.models[name].loras
    runner = _switching(config, name, engines, unet, "onnxruntime", tmp_path, capacity=2)
    feeds = _feeds(runner)
    base = _output(runner, feeds)

    assert runner.select([("style", 1.0)]) > 0
    style = _output(runner, feeds)
    expected = _output(_reference(config, name, unet, "onnxruntime", [(loras["style"].path, 1.0)]), feeds)
    assert np.abs(style - expected).max() < REFIT_TOLERANCE
    assert np.abs(style - base).max() > 100 * REFIT_TOLERANCE  # the LoRA moves the output

    mixed = [("style", 0.8), ("detail", -0.5)]
    runner.select(list(reversed(mixed)))  # any order: the same canonical set
    both = _output(runner, feeds)
    expected = _output(_reference(config, name, unet, "onnxruntime",
                                  [(loras["style"].path, 0.8), (loras["detail"].path, -0.5)]), feeds)
    assert np.abs(both - expected).max() < REFIT_TOLERANCE

    assert runner.switches == 2
    start = time.perf_counter()
    runner.select([("style", 1.0)])  # kept (LRU of 2): a lookup
    assert runner.switches == 2 and time.perf_counter() - start < 0.05
    assert np.array_equal(_output(runner, feeds), style)  # A -> B -> A: bit-exact
    runner.select([("detail", 1.0)])  # a third set evicts the least recently used (the mixed one)
    assert runner.switches == 3 and len(runner.applied) == 2
    runner.select(mixed)
    assert runner.switches == 4  # evicted: refitted again, from base, to the same bits
    assert np.array_equal(_output(runner, feeds), both)
    runner.select([])
    assert np.array_equal(_output(runner, feeds), base)  # back to base: the base engine itself
    runner.select([("style", 0.0), ("unknown-here", 1.0)])  # nothing of it is this engine's: the base
    assert runner.current is runner.base


def test_openvino_switches_by_refit_and_back_exactly(built_sd15_workflows, tmp_path):
    pytest.importorskip("openvino")
    config, name, engines, unet = _unet(built_sd15_workflows, "openvino")
    loras = config.models[name].loras
    runner = _switching(config, name, engines, unet, "openvino", tmp_path)
    feeds = _feeds(runner)
    base = _output(runner, feeds)
    runner.select([("style", 1.0)])
    full = _output(runner, feeds)
    expected = _output(_reference(config, name, unet, "openvino", [(loras["style"].path, 1.0)]), feeds)
    # the same compiled graph and threads with equal weights up to float32 rounding of the delta (bf16 where the
    # CPU has AMX: a rounding can flip a bf16 weight, so the bound is bf16's, far below what the LoRA moves)
    moved = np.abs(full - base).max()
    assert np.abs(full - expected).max() < moved / 20
    runner.select([("style", 0.5)])
    half = _output(runner, feeds)
    assert np.abs(half - full).max() > 0
    runner.select([("style", 1.0)])
    assert np.array_equal(_output(runner, feeds), full)
    runner.select([])
    assert np.array_equal(_output(runner, feeds), base)
