"""LoRA per request over the real tritonserver (issue 28, acceptance 2): a repository packaged from engines.yaml's two
refit LoRAs, `style` and `detail`, switched by hot refit in the one UNet engine instance while two entry instances
interleave their steps there.

Two LoRAs alternated across 8 concurrent requests (no-CFG requests that may share a batch-2 UNet call, so only the
batch key keeps the sets apart) -> every image equals its single-request image bit for bit; the next base request
equals the base image; bad LORAS are refused by name and the server stays healthy.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.triton import client as triton_client
from trt_diffusion.triton import stage
from trt_diffusion.triton.client import ImageRequest

pytestmark = [pytest.mark.triton, pytest.mark.slow]

SIZE = 64
STYLE = json.dumps([{"name": "style", "scale": 1.0}])
DETAIL = json.dumps([{"name": "detail", "scale": 0.7}])
CONCURRENT = 8


@pytest.fixture(scope="module")
def served(built_sd15_two_loras, tmp_path_factory):
    from trt_diffusion.triton.repository import PackageOptions

    root = tmp_path_factory.mktemp("lora-serving")
    # batch_requests 4: no-CFG requests of one set share the UNet's batch-2 calls; cache of 2 sets: both kept
    options = PackageOptions(pipeline_instances=2, batch_requests=4, lora_cache_sets=2, ensemble=False,
                             stream=False)
    report = stage.package_stage(built_sd15_two_loras, root / "repo", "onnxruntime", options=options)
    server, _ = stage.start(root / "repo", work_dir=root / "work", first_request=False)
    try:
        yield server, report
    finally:
        server.stop()


def generate(served, loras: str | None, seed: int = 0) -> tuple[np.ndarray, dict]:
    server, report = served
    request = ImageRequest("a lighthouse on a cliff", SIZE, SIZE, steps=3, guidance_scale=1.0, seed=seed, loras=loras)
    images, parameters = triton_client.generate_images(server.grpc_url, request, pipeline=report.entry,
                                                       protocol="grpc", timeout_s=300)
    return images[0], parameters


def test_sets_alternated_concurrently_equal_their_single_request_images(served):
    base, _ = generate(served, None)
    single = {}
    for loras in (STYLE, DETAIL):
        single[loras], parameters = generate(served, loras)
        assert parameters["timing"]["lora_switch_s"] > 0  # first use: refitted
        assert not np.array_equal(single[loras], base)  # the LoRA changes the image
    assert not np.array_equal(single[STYLE], single[DETAIL])
    _, parameters = generate(served, STYLE)
    assert parameters["timing"]["lora_switch_s"] < 0.05  # kept in the instance's LRU: a lookup

    sets = [STYLE if i % 2 == 0 else DETAIL for i in range(CONCURRENT)]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        results = list(pool.map(lambda loras: generate(served, loras), sets))
    for loras, (image, _) in zip(sets, results):
        assert np.array_equal(image, single[loras])
    after, parameters = generate(served, "[]")
    assert np.array_equal(after, base)  # the next base request: the base engine, no residue
    assert parameters["timing"]["lora_switch_s"] == 0


@pytest.mark.parametrize("loras, message", [
    ('[{"name": "anime"}]', "unknown LoRA 'anime'; this model serves: detail, style"),
    ("[{", "LORAS is not valid JSON"),
    ('[{"name": "style", "weight": 1}]', "LORAS[0] has unknown key(s) ['weight']"),
    ('[{"name": "style", "scale": "x"}]', 'LORAS[0].scale must be a number, got "x"'),
    ('[{"name": "style"}, {"name": "style"}]', "LORAS names 'style' twice"),
])
def test_bad_loras_are_refused_by_name_and_the_server_stays_up(served, loras, message):
    with pytest.raises(ServeError) as err:
        generate(served, loras)
    assert message in str(err.value)
    image, _ = generate(served, STYLE)
    assert image.shape == (SIZE, SIZE, 3)
