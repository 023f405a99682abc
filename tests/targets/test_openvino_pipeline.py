"""The tiny sd15 pipeline on the openvino target against real OpenVINO: `build --target openvino` and
`parity` pass at fp32 (with a refit LoRA), int8 (the Q/DQ ONNX) and bf16 (where the CPU computes bf16; a
clear refusal elsewhere), and the Triton repository serves the images the in-process pipeline makes."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import yaml

pytest.importorskip("openvino", reason="the openvino extra is not installed (pip install 'trt-diffusion[openvino]')")

from trt_diffusion import api  # noqa: E402
from trt_diffusion.targets.openvino import host  # noqa: E402


def _variant(built_sd15, root, name, unet_precision):
    """engines.yaml like built_sd15's with the openvino target, in a workspace holding a copy of its
    exported ONNX (so nothing is exported again)."""
    folder = root / name
    workspace = root / "build"
    if not (workspace / "onnx").exists():
        shutil.copytree(built_sd15.parent / "build" / "onnx", workspace / "onnx")
    data = yaml.safe_load(built_sd15.read_text())
    data["build"]["workspace"] = str(workspace)
    model = next(iter(data["models"].values()))
    model["targets"] = ["openvino"]
    model["precision"] = {**model["precision"], "unet": unet_precision}
    model.pop("controlnets", None)
    if unet_precision != "fp32":
        model.pop("loras", None)  # int8/bf16 variants here: no refit LoRA
    from trt_diffusion.engines_file.schema import EnginesFile

    if "preflight" in EnginesFile.model_fields:
        data["preflight"] = {"target": "openvino"}
    folder.mkdir(parents=True)
    path = folder / "engines.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def variants(built_sd15, tmp_path_factory):
    root = tmp_path_factory.mktemp("openvino-pipeline")
    return {p: _variant(built_sd15, root, p, p) for p in ("fp32", "int8", "bf16")}


def _parity(config, out):
    run = api.parity(config, out_dir=out, steps=2, targets=["openvino"])
    return run.report


@pytest.mark.slow  # OpenVINO end to end with a refit LoRA (about 40 s); the conformance suite keeps openvino in the default run
def test_fp32_builds_and_passes_parity_with_its_refit_lora(variants, tmp_path):
    report = api.build(variants["fp32"], target="openvino")
    assert not report.failed and len(report.outcomes) == 3, [o.error for o in report.failed]
    parity = _parity(variants["fp32"], tmp_path / "parity")
    assert parity.passed and [v.precision for v in parity.variants] == ["fp32"]
    assert all(image.psnr_db > 40 for v in parity.variants for image in v.images)
    unet = next(o for o in report.outcomes if o.spec.component == "unet")
    assert unet.spec.refittable
    lora = next(iter(yaml.safe_load(variants["fp32"].read_text())["models"].values()))["loras"]["style"]["source"]
    refitted = dict((name, count) for name, count, _ in api.refit(variants["fp32"], "sd15-tiny", [(lora, 1.0)],
                                                                  target="openvino"))
    assert refitted[unet.spec.name] > 0


@pytest.mark.slow  # ModelOpt calibration + Q/DQ export: minutes on 2 shared cores
def test_int8_builds_from_the_qdq_onnx_in_int8_and_passes_parity(variants, tmp_path):
    report = api.build(variants["int8"], target="openvino")
    assert not report.failed, [o.error for o in report.failed]
    unet = next(o for o in report.outcomes if o.spec.component == "unet")
    from trt_diffusion.targets.openvino.engine import read_manifest

    manifest = read_manifest(unet.path)
    assert manifest.quantized == "i8" and manifest.runtime_precisions.get("i8", 0) > 0
    assert _parity(variants["int8"], tmp_path / "parity").passed


def test_bf16_passes_parity_where_the_cpu_has_bf16_and_is_refused_elsewhere(variants, tmp_path):
    report = api.build(variants["bf16"], target="openvino")
    unet = next(o for o in report.outcomes if o.spec.component == "unet")
    if "BF16" in host.cpu_facts().capabilities:
        assert not report.failed, [o.error for o in report.failed]
        assert _parity(variants["bf16"], tmp_path / "parity").passed
    else:
        assert unet.failure is not None and not unet.failure.internal
        assert "cannot compute bf16 natively" in unet.failure.message and "AMX" in unet.failure.message
        # The refusal is the UNet's alone: the other engines of the variant still build (or are reused).
        assert [o.failure for o in report.outcomes if o is not unet] == [None, None]


@pytest.mark.triton
@pytest.mark.slow  # a server start and warm-up (~30 s); the in-process pipeline above runs by default
def test_triton_serves_the_images_of_the_in_process_openvino_pipeline(variants, tmp_path):
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import built_engines, table_from_engines
    from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
    from trt_diffusion.triton import client as triton_client
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.client import ImageRequest
    from trt_diffusion.triton.repository import package

    config_path = variants["fp32"]
    api.build(config_path, target="openvino")
    config = load_engines_file(config_path, check_sources=True)
    model = config.models["sd15-tiny"]
    engines = built_engines(config, "sd15-tiny", "openvino")
    report = package(engines, model.source.path, model.family, "sd15-tiny", tmp_path / "repo")
    server, _ = stage.start(tmp_path / "repo", work_dir=tmp_path / "work", protocol="grpc")
    try:
        image_request = ImageRequest(prompt="a lighthouse at dusk", height=64, width=64, steps=3,
                                     guidance_scale=7.5, seed=5)
        module = triton_client.client_module("grpc")
        client = triton_client.connect(server.grpc_url, "grpc", 120)
        try:
            image = triton_client.infer(client, module, report.entry, image_request, protocol="grpc",
                                        timeout_s=120, url=server.grpc_url)
        finally:
            client.close()
    finally:
        server.stop()
    local = EnginePipeline(model.source.path, model.family, table_from_engines(engines))
    expected = local.generate(GenerationRequest(prompt=image_request.prompt, height=64, width=64, steps=3,
                                                guidance_scale=7.5, seed=5)).images[0]
    # Bit-identical: the same IR, precision and thread count (one instance gets every core) in both.
    np.testing.assert_array_equal(image, expected)
    assert image.std() > 1
