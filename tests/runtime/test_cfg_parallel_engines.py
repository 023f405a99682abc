"""`cfg: parallel` over built engines (issue #24): tiny Wan 2.1 at 32x32x5, `cfg: [batched, parallel]`, on
onnxruntime and openvino. The loader gives the transformer two runners (two ONNX Runtime sessions, two OpenVINO
compiled models: one infer request each), the pipeline calls them at once, and the video equals split's over the
same engines bit for bit; batched (one batch-2 call a step, which rounds differently) passes the parity gate's
bars against it (metrics.video_metrics, the fp32 thresholds, the motion check). Slow: the engines are built
(about a minute).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.metrics import thresholds_for, video_metrics
from trt_diffusion.runtime.engines import RunnerTable
from trt_diffusion.runtime.loader import built_engines, table_from_engines
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TARGETS = ("onnxruntime", "openvino")
FP32 = {"text_encoder": "fp32", "transformer": "fp32", "vae_decoder": "fp32"}


@pytest.fixture(scope="module")
def wan_config(tiny_model_factory, write_engines_yaml, tmp_path_factory):
    path = write_engines_yaml(tmp_path_factory.mktemp("wan-cfg-parallel"), tiny_model_factory("wan"), "wan",
                              buckets=["32x32x5"], cfg=["batched", "parallel"], targets=list(TARGETS), precision=FP32)
    report = api.build(path)
    assert not report.failed, [o.error for o in report.failed]
    return load_engines_file(path, check_sources=True)


def pipelines(config, target: str) -> dict[str, EnginePipeline]:
    model = config.models["wan-tiny"]
    engines = built_engines(config, "wan-tiny", target)
    table = table_from_engines(engines, cfg=model.cfg)  # what engine_runners (generate --config) builds
    batched = RunnerTable([e for e in table.entries if e.component != "transformer" or e.batch == 2])
    return {"parallel": EnginePipeline(model.source.path, model.family, table, cfg=model.cfg),
            "split": EnginePipeline(model.source.path, model.family, table),  # the same runners, cfg not given
            "batched": EnginePipeline(model.source.path, model.family, batched)}


@pytest.mark.parametrize("target", TARGETS)
def test_parallel_equals_split_bit_for_bit_and_batched_within_the_parity_gate(wan_config, target):
    pipes = pipelines(wan_config, target)
    entry = next(e for e in pipes["parallel"].runners.entries if e.component == "transformer" and e.batch == 1)
    assert len(entry.instances) == 1 and entry.instances[0] is not entry.runner  # a second session / compiled model
    assert next(e for e in pipes["parallel"].runners.entries if e.component == "text_encoder").instances == ()

    threads: dict[str, set[int]] = {"first": set(), "second": set()}
    for name, runner in (("first", entry.runner), ("second", entry.instances[0])):
        original = runner.run

        def run(feeds, original=original, name=name):
            threads[name].add(threading.get_ident())
            return original(feeds)

        runner.run = run  # which thread each instance is called from
    request = GenerationRequest("a red fox running through snow", 32, 32, steps=4, guidance_scale=5.0, seed=11,
                                frames=5)
    videos = {}
    for mode, pipe in pipes.items():
        generation = pipe.generate(request)
        assert generation.cfg_mode == mode
        videos[mode] = generation.images[0]
    np.testing.assert_array_equal(videos["parallel"], videos["split"])
    assert threads["second"] and threads["second"] != {threading.get_ident()}  # the second half: a worker thread

    figures = video_metrics(videos["split"], videos["batched"])
    bar = thresholds_for("fp32")
    assert not bar.image_failures(figures.min_psnr_db, figures.min_ssim, None), figures.to_json()
    assert not bar.motion_failures(figures.motion_rmse, figures.reference_motion), figures.to_json()


def test_generate_config_builds_two_sessions_for_a_parallel_model(wan_config):
    """engine_runners (what `generate --config` runs on) reads the model's cfg: two transformer runners."""
    from trt_diffusion.runtime.loader import engine_runners

    _, _, table = engine_runners(wan_config, "wan-tiny", "onnxruntime")
    counts = {(e.component, e.batch): 1 + len(e.instances) for e in table.entries}
    assert counts == {("text_encoder", 1): 1, ("transformer", 1): 2, ("transformer", 2): 2, ("vae_decoder", 1): 1}
