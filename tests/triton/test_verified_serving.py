"""`serve --verify` end to end with the real tritonserver (issue 44, findings 1 and 2).

- A planted `default_model_filename: "evil.py"` line and the `1/evil.py` it names, in a signed repository: refused
  before tritonserver starts, and the planted code never runs (before: the release verified and the file ran).
- A swap between verification and load, made through `stage.start`'s `after_verify` seam (not a sleep): an engine
  of the published repository rewritten and its manifest resealed, as anyone who can write the repository can.
  The verified server serves the image of the verified engines (bit-equal to the in-process pipeline over the
  untouched workspace); the same swapped repository served without --verify gives another image, so the swap
  is real and the test can fail (before: the server loaded the swapped engine).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
import pytest

from trt_diffusion.onnx_facts import onnx_sha256
from trt_diffusion.signing import SignatureError
from trt_diffusion.triton import client as triton_client
from trt_diffusion.triton import stage
from trt_diffusion.triton.client import ImageRequest
from trt_diffusion.triton.report import PackageReport
from trt_diffusion.workspace.files import sha256_file

pytestmark = [pytest.mark.triton, pytest.mark.slow]

REQUEST = ImageRequest(prompt="a lighthouse on a cliff at dusk", height=64, width=64, steps=2, guidance_scale=7.5,
                       seed=3)


@pytest.fixture
def repo(sealed_sd15, tmp_path):
    copy = tmp_path / "published"
    shutil.copytree(sealed_sd15.repo, copy)  # files copied, not linked: the workspace stays untouched
    return copy


def _served_image(server, repo) -> np.ndarray:
    entry = PackageReport.read(repo).entry
    client = triton_client.connect(server.grpc_url, "grpc", 120.0)
    try:
        return triton_client.infer(client, triton_client.client_module("grpc"), entry, REQUEST, protocol="grpc",
                                   timeout_s=120.0, url=server.grpc_url)
    finally:
        client.close()


def _local_image(config) -> np.ndarray:
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import built_engines, table_from_engines
    from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest

    loaded = load_engines_file(config, check_sources=True)
    (name,) = loaded.models
    model = loaded.models[name]
    pipeline = EnginePipeline(model.source.path, model.family,
                              table_from_engines(built_engines(loaded, name, "onnxruntime")))
    return pipeline.generate(GenerationRequest(
        prompt=REQUEST.prompt, negative_prompt=REQUEST.negative_prompt, height=REQUEST.height, width=REQUEST.width,
        steps=REQUEST.steps, guidance_scale=REQUEST.guidance_scale, seed=REQUEST.seed)).images[0]


def _swap_unet(repo) -> None:
    """Double the UNet's largest weight in the published repository (a new file renamed over the old, as a
    deploy tool would) and reseal the engine's own manifest: only the release signature can tell."""
    graph = next(p for p in repo.glob("*/1/model.onnx") if "unet" in p.parent.parent.name)
    model = onnx.load(graph, load_external_data=False)
    largest = max(model.graph.initializer, key=lambda t: int(next(
        (e.value for e in t.external_data if e.key == "length"), 0)))
    fields = {e.key: e.value for e in largest.external_data}
    data = graph.parent / fields["location"]
    payload = bytearray(data.read_bytes())
    start, length = int(fields.get("offset", 0)), int(fields["length"])
    weights = np.frombuffer(bytes(payload[start:start + length]), dtype=np.float32) * 2
    payload[start:start + length] = weights.astype(np.float32).tobytes()
    replacement = data.with_name(data.name + ".swap")
    replacement.write_bytes(bytes(payload))
    os.replace(replacement, data)
    manifest_path = graph.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["engine_sha256"] = onnx_sha256(graph)
    manifest["file_sha256"] = {name: sha256_file(graph.parent / name) for name in manifest["file_sha256"]}
    manifest_path.write_text(json.dumps(manifest, indent=2))


def test_a_planted_config_line_and_file_never_run(repo, sealed_sd15, tmp_path):
    marker = tmp_path / "planted-code-ran"
    pipeline = next(p.parent.parent for p in repo.glob("*/1/model.py") if "pipeline_model" in p.read_text())
    (pipeline / "config.pbtxt").write_text((pipeline / "config.pbtxt").read_text()
                                           + '\ndefault_model_filename: "evil.py"\n')
    evil = (pipeline / "1" / "model.py").read_text() + f"\nopen({str(marker)!r}, 'w').close()\n"
    (pipeline / "1" / "evil.py").write_text(evil)
    with pytest.raises(SignatureError, match=r"not covered by the signed repository|differs from the signed"):
        stage.start(repo, verify_keys=[sealed_sd15.public_key], work_dir=tmp_path / "work", first_request=False)
    assert not marker.exists()
    assert not (tmp_path / "work" / "verified-repository").exists()


def test_a_swap_after_verification_is_not_served(repo, sealed_sd15, tmp_path):
    expected = _local_image(sealed_sd15.config)
    swaps = []
    server, _ = stage.start(repo, verify_keys=[sealed_sd15.public_key], work_dir=tmp_path / "verified",
                            first_request=False, after_verify=lambda: swaps.append(_swap_unet(repo)))
    try:
        verified = _served_image(server, repo)
    finally:
        server.stop()
    assert swaps, "the seam ran"
    np.testing.assert_array_equal(verified, expected)

    server, _ = stage.start(repo, work_dir=tmp_path / "unverified", first_request=False)  # the finding's server
    try:
        swapped = _served_image(server, repo)
    finally:
        server.stop()
    assert np.abs(swapped.astype(int) - expected.astype(int)).max() > 0, "the swap changed nothing: a void test"
