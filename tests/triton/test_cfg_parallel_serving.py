"""`cfg: parallel` on the real tritonserver (issue #24): tiny Wan 2.1 at 32x32x5, onnxruntime engines. `package`
records the mode in pipeline.json (and the entry's `cfg` parameter, and the package report) and gives the
transformer's engine model two CPU instances — two python stub processes — while the text encoder and the VAE keep
one; the entry's BLS issues a step's two calls at once; the served videos equal the in-process parallel
pipeline's and split's bit for bit, over HTTP and gRPC.

That the calls overlap in the server is recorded inside the transformer's engine model: the two calls of every
step run at the same time, in its two instances' processes.
Slow: the engines are built and the server started (about a minute and a half).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trt_diffusion.triton import client as triton_client
from trt_diffusion.triton.client import ImageRequest

pytestmark = [pytest.mark.triton, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "a red fox running through snow"
SIZE, FRAMES = 32, 5  # the bucket tests/conftest.py's built_wan builds


@pytest.fixture(scope="module")
def wan_workspace(built_wan) -> Path:
    return built_wan("parallel")


@pytest.fixture(scope="module")
def local_pipelines(wan_workspace):
    """(parallel, split): EnginePipelines over the same engines in this process."""
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import engine_runners
    from trt_diffusion.runtime.pipeline import EnginePipeline

    config = load_engines_file(wan_workspace, check_sources=True)
    model_dir, family, table = engine_runners(config, "wan", "onnxruntime")
    return (EnginePipeline(model_dir, family, table, cfg=config.models["wan"].cfg),
            EnginePipeline(model_dir, family, table))


# The transformer's engine model, packaged, with each execute recorded (process, start, end on the host's monotonic
# clock, which every process shares) and held 20 ms: long enough that two calls made one after another could never
# overlap on a busy 2-core host, however late a thread is scheduled. The engine's outputs are untouched.
RECORDING_MODEL_PY = """import os
import time

from trt_diffusion.triton.backend.engine_model import TritonPythonModel as _EngineModel

CALLS = {calls!r}


class TritonPythonModel(_EngineModel):
    def execute(self, requests):
        start = time.monotonic_ns()
        time.sleep(0.02)
        try:
            return super().execute(requests)
        finally:
            with open(CALLS, "a") as log:
                log.write(f"{{os.getpid()}} {{start}} {{time.monotonic_ns()}}\\n")
"""


@pytest.fixture(scope="module")
def served(wan_workspace, tmp_path_factory):
    """(server, package report, repository, the transformer model's call log): started as `serve` starts it."""
    from trt_diffusion.triton import stage

    root = tmp_path_factory.mktemp("wan-cfg-parallel-repo")
    report = stage.package_stage(wan_workspace, root / "repo")
    calls = root / "transformer-calls.txt"
    (transformer,) = [m.name for m in report.engine_models() if m.component == "transformer"]
    (root / "repo" / transformer / "1" / "model.py").write_text(RECORDING_MODEL_PY.format(calls=str(calls)))
    server, _ = stage.start(root / "repo", work_dir=root / "work", first_request=True)
    try:
        yield server, report, root / "repo", calls
    finally:
        server.stop()


def video_request(**change) -> ImageRequest:
    values = dict(prompt=PROMPT, height=SIZE, width=SIZE, steps=3, guidance_scale=5.0, seed=7, frames=FRAMES)
    values.update(change)
    return ImageRequest(**values)


def local(pipeline, request: ImageRequest, seed_offset: int = 0):
    from trt_diffusion.runtime.pipeline import GenerationRequest

    generation = pipeline.generate(GenerationRequest(
        prompt=request.prompt, height=request.height, width=request.width, steps=request.steps,
        guidance_scale=request.guidance_scale, seed=request.seed + seed_offset, frames=request.frames))
    return generation.images[0], generation.cfg_mode


def test_the_repository_records_parallel_and_gives_the_transformer_two_instances(served):
    from trt_diffusion.triton.description import PipelineDescription
    from trt_diffusion.triton.validate import read_configs

    _, report, repo, _ = served
    assert report.cfg == ["parallel"]
    assert PipelineDescription.read(repo / report.entry / "1").cfg == ("parallel",)
    models = read_configs(repo)
    assert models[report.entry].parameters["cfg"].string_value == "parallel"
    counts = {m.component: [(g.count, list(g.gpus)) for g in models[m.name].instance_group]
              for m in report.engine_models()}
    assert counts == {"transformer": [(2, [])], "text_encoder": [(1, [])], "vae_decoder": [(1, [])]}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_videos_equal_in_process_parallel_and_split(served, local_pipelines, protocol):
    server, _, _, _ = served
    parallel, split = local_pipelines
    url = server.http_url if protocol == "http" else server.grpc_url
    videos, _ = triton_client.generate_images(url, video_request(num_images=2), protocol=protocol)
    assert videos.shape == (2, FRAMES, SIZE, SIZE, 3)
    for k in range(2):  # NUM_IMAGES videos: seeds SEED, SEED + 1
        in_process, mode = local(parallel, video_request(), k)
        assert mode == "parallel"
        np.testing.assert_array_equal(videos[k], in_process)
        split_video, mode = local(split, video_request(), k)
        assert mode == "split"
        np.testing.assert_array_equal(videos[k], split_video)


def recorded_calls(log: Path) -> list[tuple[int, int, int]]:
    """(process, start ns, end ns) of every transformer execute so far, in start order."""
    lines = log.read_text().splitlines() if log.is_file() else []
    return sorted((tuple(int(v) for v in line.split()) for line in lines), key=lambda call: call[1])


def test_the_two_calls_of_a_step_overlap_on_two_instances(served):
    """Each step's two transformer calls run at the same time, in the two instances' processes; calls one after
    another would each start after the one before had ended."""
    server, _, _, log = served
    seen = len(recorded_calls(log))
    triton_client.generate_images(server.http_url, video_request(steps=6), protocol="http")
    calls = recorded_calls(log)[seen:]
    assert len(calls) == 12  # 6 steps × (conditional, unconditional)
    for first, second in (calls[i:i + 2] for i in range(0, 12, 2)):
        assert second[1] < first[2], calls  # the second started before the first had ended
        assert first[0] != second[0], calls  # on the other instance (its own stub process)
