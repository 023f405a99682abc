"""LoRA per request over the real tritonserver (issue 28, acceptance 2): a repository packaged from engines.yaml's two
refit LoRAs, `style` and `detail`, switched by hot refit in the one UNet engine instance while two entry instances
interleave their steps there.

The serving metrics (acceptance 4) are scraped from Triton's metrics port after a known load: exact counts.

Two LoRAs alternated across 8 concurrent requests (no-CFG requests that may share a batch-2 UNet call, so only the
batch key keeps the sets apart) -> every image equals its single-request image bit for bit; the next base request
equals the base image; bad LORAS are refused by name and the server stays healthy.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
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
    options = PackageOptions(pipeline_instances=2, batch_requests=4, lora_cache_sets=2)
    report = stage.package_stage(built_sd15_two_loras, root / "repo", "onnxruntime", options=options)
    server, _ = stage.start(root / "repo", work_dir=root / "work", first_request=False)
    try:
        yield server, report
    finally:
        server.stop()


def generate(served, loras: str | None, seed: int = 0, *, steps: int = 3, num_images: int | None = None,
             timeout_s: float = 300, guidance_scale: float = 1.0) -> tuple[np.ndarray, dict]:
    server, report = served
    request = ImageRequest("a lighthouse on a cliff", SIZE, SIZE, steps=steps, guidance_scale=guidance_scale, seed=seed,
                           loras=loras, num_images=num_images)
    images, parameters = triton_client.generate_images(server.grpc_url, request, pipeline=report.entry,
                                                       protocol="grpc", timeout_s=timeout_s)
    return images[0], parameters


def test_sets_alternated_concurrently_equal_their_single_request_images(served):
    base, _ = generate(served, None)
    single = {}
    for loras in (STYLE, DETAIL):
        single[loras], parameters = generate(served, loras)
        assert parameters["timing"]["lora_switch_s"] > 0  # first use: refitted
        assert not np.array_equal(single[loras], base)  # the LoRA changes the image
    assert not np.array_equal(single[STYLE], single[DETAIL])
    before = scrape(served)
    generate(served, STYLE)
    # kept in the instance's LRU: the UNet's switch to it is counted as found there, not refitted (the event, not
    # a duration: a busy CI machine may take any time over a lookup)
    assert lora_switches(served, before) == {"refit": 0, "cached": 1, "base": 0}

    sets = [STYLE if i % 2 == 0 else DETAIL for i in range(CONCURRENT)]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        results = list(pool.map(lambda loras: generate(served, loras), sets))
    for loras, (image, _) in zip(sets, results):
        assert np.array_equal(image, single[loras])
    after, parameters = generate(served, "[]")
    assert np.array_equal(after, base)  # the next base request: the base engine, no residue
    assert parameters["timing"]["lora_switch_s"] == 0


def test_the_ensemble_and_the_stream_apply_the_set_too(served):
    """LORAS through the ensemble (its encode and denoise stages hand the set to their engine calls) and the streaming
    entry: the entry's image."""
    server, report = served
    both = json.dumps([{"name": "detail", "scale": 0.5}, {"name": "style", "scale": 0.5}])
    expected, _ = generate(served, both, seed=5)
    request = ImageRequest("a lighthouse on a cliff", SIZE, SIZE, steps=3, guidance_scale=1.0, seed=5, loras=both)
    module = triton_client.client_module("grpc")
    client = triton_client.connect(server.grpc_url, "grpc", 300)
    try:
        ensemble = triton_client.infer(client, module, report.ensemble, request, protocol="grpc", timeout_s=300)
    finally:
        client.close()
    streamed, _, _ = triton_client.stream(server.grpc_url, request, model=f"{report.entry}_stream", timeout_s=300)
    assert np.array_equal(ensemble, expected) and np.array_equal(streamed, expected)
    base, _ = generate(served, None, seed=5)
    assert not np.array_equal(base, expected)


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


SAMPLE = re.compile(r'^(trt_diffusion_\w+)(?:\{(.*)\})? (\S+)$')


def scrape(served) -> dict[tuple[str, frozenset], float]:
    """Triton's /metrics, our families only: (name, labels) -> value."""
    server, _ = served
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def lora_switches(served, before: dict) -> dict[str, float]:
    """The UNet engine's LoRA switches since the `before` scrape, by result (refit, cached, base)."""
    _, report = served
    (unet,) = [m.name for m in report.models if m.component == "unet"]
    now = scrape(served)

    def delta(result: str) -> float:
        key = ("trt_diffusion_lora_switches_total", frozenset({"model": unet, "result": result}.items()))
        return now.get(key, 0.0) - before.get(key, 0.0)

    return {result: delta(result) for result in ("refit", "cached", "base")}


def test_metrics_count_a_known_load_exactly(served):
    """Deltas over a known load: 5 images in 4 requests (one NUM_IMAGES=2) of 3 steps, two refused, one cancelled
    by its deadline; in the UNet engine instance two sets refitted, one found in its LRU, one return to base."""
    _, report = served
    entry = report.entry
    (unet,) = [m.name for m in report.models if m.component == "unet"]
    generate(served, None)  # the engine at base: the switches below are known
    before = scrape(served)
    style, detail = json.dumps([{"name": "style", "scale": 0.3}]), json.dumps([{"name": "detail", "scale": 0.3}])
    generate(served, style, num_images=2)  # sets no earlier test used: refitted
    generate(served, detail)
    generate(served, style)  # kept (an LRU of 2)
    generate(served, None)  # back to base
    for bad in ('[{"name": "anime"}]', "[{"):
        with pytest.raises(ServeError):
            generate(served, bad)
    with pytest.raises(ServeError, match="(?i)deadline"):  # 1000 CFG steps, a 1 s deadline: cancelled as it runs
        generate(served, None, steps=1000, timeout_s=1, guidance_scale=7.5)

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return scrape_now.get(key, 0.0) - before.get(key, 0.0)

    deadline = time.monotonic() + 120  # the cancelled request is counted when the entry notices (next step)
    scrape_now = scrape(served)
    while delta("trt_diffusion_cancellations_total", model=entry) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
        scrape_now = scrape(served)
    labels = {"model": entry, "bucket": f"{SIZE}x{SIZE}", "workflow": "txt2img"}
    assert delta("trt_diffusion_images_total", **labels) == 5
    assert delta("trt_diffusion_steps_total", **labels) == 15
    assert delta("trt_diffusion_refusals_total", model=entry) == 2
    assert delta("trt_diffusion_cancellations_total", model=entry) == 1
    assert delta("trt_diffusion_queue_wait_seconds_count", model=entry) == 5  # every request that ran
    assert delta("trt_diffusion_lora_switches_total", model=unet, result="refit") == 2
    assert delta("trt_diffusion_lora_switches_total", model=unet, result="cached") == 1
    assert delta("trt_diffusion_lora_switches_total", model=unet, result="base") == 1


def test_generate_lora_option_gives_the_request_image(served, tmp_path, capsys):
    """`trt-diffusion generate --lora NAME[:SCALE]` (repeatable) sends LORAS: its PNG holds the image of the same
    request sent with LORAS as JSON."""
    from PIL import Image

    from trt_diffusion.cli import main

    server, report = served
    both = json.dumps([{"name": "detail", "scale": -0.4}, {"name": "style", "scale": 1.0}])
    expected, _ = generate(served, both, seed=3)
    args = ["generate", "--url", f"grpc://{server.grpc_url}", "--pipeline", report.entry, "--prompt",
            "a lighthouse on a cliff", "--steps", "3", "--guidance-scale", "1", "--seed", "3", "--height", str(SIZE),
            "--width", str(SIZE), "--lora", "style", "--lora", "detail:-0.4", "-o", str(tmp_path / "out.png")]
    assert main(args) == 0, capsys.readouterr().err
    assert np.array_equal(np.asarray(Image.open(tmp_path / "out.png").convert("RGB")), expected)
