"""The export stage frees the torch module before the graph passes and the ONNX Runtime parity session,
and reports each stage as a live progress line."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest

from trt_diffusion import api, progress
from trt_diffusion.export import parity
from trt_diffusion.export import stage as pipeline


@pytest.mark.slow  # its own export of the tiny model (~20 s)
def test_the_module_is_freed_before_the_parity_session(tmp_path, tiny_model_dir, write_engines_yaml, monkeypatch,
                                                       caplog):
    loaded: list[weakref.ref] = []
    alive_at_session: list[bool] = []
    real_load, real_open = pipeline.load_group_module, parity.open_session

    def load(group, model):
        module = real_load(group, model)
        loaded.append(weakref.ref(module))
        return module

    def open_session(onnx_path, label):
        gc.collect()
        alive_at_session.append(any(ref() is not None for ref in loaded))
        return real_open(onnx_path, label)

    monkeypatch.setattr(pipeline, "load_group_module", load)
    monkeypatch.setattr(parity, "open_session", open_session)
    config = write_engines_yaml(tmp_path, tiny_model_dir("sd15"), "sd15", components=["unet", "vae_decoder"],
                                precision={"unet": "fp16", "vae_decoder": "fp32"})
    with caplog.at_level(logging.INFO, logger=progress.LOGGER_NAME):
        report = api.export(config)
    assert len(loaded) == 2 and alive_at_session == [False, False]
    for result in report.results:  # still verified, at the same shapes as before
        checks = result.parity
        assert checks and all(c["passed"] for c in checks) and len({c["geometry"] for c in checks}) >= 2
    lines = [r.getMessage() for r in caplog.records if r.name == progress.LOGGER_NAME]
    assert any("export 1/2 sd15-tiny.unet.fp16: torch.onnx.export" in line for line in lines), lines
    assert any("export 2/2 sd15-tiny.vae_decoder.fp32: ONNX Runtime vs PyTorch" in line for line in lines), lines
