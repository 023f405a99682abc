"""Signed releases (issue 32, finding 3 and acceptance 3): an engine re-sealed after tampering (its manifest's
unkeyed sha256 recomputed, so `find()` trusts it) is refused by `package --verify` and `serve --verify`; a
release signed by another key, altered after signing, or unsigned is refused; `build.trust: signed` on a
file:// workspace makes package require --verify. Real engines (the session's tiny sd15 build), real keys."""

from __future__ import annotations

import json

import pytest
import yaml
from signed_release import signed_workspace_copy

from trt_diffusion import signing
from trt_diffusion.onnx_facts import onnx_sha256
from trt_diffusion.signing import SignatureError
from trt_diffusion.triton import stage
from trt_diffusion.triton.release_check import verify_repository
from trt_diffusion.workspace.files import sha256_file


@pytest.fixture
def workspace(tmp_path, built_sd15):
    """A copy of the built tiny workspace, its release manifest made (verified) and signed."""
    config, _, public = signed_workspace_copy(built_sd15, tmp_path)
    return config, public, tmp_path


def _reseal(engine_folder):
    """What anyone who can write the workspace can do: change a byte, recompute the manifest's sha256s."""
    data = engine_folder / "model.onnx.data"
    if not data.is_file():
        data = engine_folder / "model.onnx"
    payload = bytearray(data.read_bytes())
    payload[len(payload) // 2] ^= 0x01
    data.write_bytes(bytes(payload))
    manifest_path = engine_folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["engine_sha256"] = onnx_sha256(engine_folder / "model.onnx")
    manifest["file_sha256"] = {name: sha256_file(engine_folder / name) for name in manifest["file_sha256"]}
    manifest_path.write_text(json.dumps(manifest, indent=2))


def test_keys_are_written_once_and_name_their_key_id(tmp_path):
    private, public, key_id = signing.generate_keys(tmp_path / "k.pem")
    assert private.stat().st_mode & 0o777 == 0o600 and b"PUBLIC KEY" in public.read_bytes()
    assert len(key_id) == 64
    with pytest.raises(Exception, match="already exists"):
        signing.generate_keys(tmp_path / "k.pem")


def test_a_signed_release_round_trip_and_a_resealed_engine(workspace):
    config, public, tmp_path = workspace
    out = tmp_path / "repo"
    stage.package_stage(config, out, verify_keys=[public], sign_key=tmp_path / "keys" / "release.pem")
    verify_repository(out, [public])  # serve --verify's check

    # a flipped byte in the packaged repository is refused by serve --verify
    served = next(p for p in out.glob("*/1/model.onnx*") if p.stat().st_size > 1000)
    original = served.read_bytes()
    served.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(SignatureError, match=r"differs from the signed repository"):
        verify_repository(out, [public])
    served.write_bytes(original)
    entry_code = next(out.glob("*/1/model.py"), None)
    pipeline_code = next(p for p in out.glob("*/1/model.py") if "pipeline_model" in p.read_text())
    pipeline_code.write_text(pipeline_code.read_text() + "\nimport os  # planted\n")
    with pytest.raises(SignatureError, match=r"model.py differs from the signed repository"):
        verify_repository(out, [public])
    assert entry_code is not None

    # a re-sealed tampered engine: its own manifest vouches for it, the signed release does not
    unet = next((config.parent / "build" / "engines" / "onnxruntime").glob("sd15-tiny.unet.*"))
    _reseal(unet)
    stage.package_stage(config, tmp_path / "unverified")  # manifest trust alone packages it: the finding
    with pytest.raises(SignatureError, match=r"engine sd15-tiny.unet.*differs from the signed release"):
        stage.package_stage(config, tmp_path / "verified", verify_keys=[public])


def test_a_workspace_checked_against_its_signed_release(workspace):
    config, public, _ = workspace
    release = config.parent / "build" / signing.RELEASE_FILE
    payload, problems = signing.verify_workspace(release, config.parent / "build", [public])
    assert problems == [] and payload["counts"]["ok"] == len(payload["engines"])
    unet = next((config.parent / "build" / "engines" / "onnxruntime").glob("sd15-tiny.unet.*"))
    _reseal(unet)
    _, problems = signing.verify_workspace(release, config.parent / "build", [public])
    assert problems and all("sd15-tiny.unet" in p and "differs from the signed release" in p for p in problems)


def test_other_keys_altered_and_unsigned_releases_are_refused(workspace):
    config, public, tmp_path = workspace
    release = config.parent / "build" / signing.RELEASE_FILE
    _, other, _ = signing.generate_keys(tmp_path / "other.pem")
    with pytest.raises(SignatureError, match=r"not by any key given to --verify"):
        stage.package_stage(config, tmp_path / "a", verify_keys=[other])
    stage.package_stage(config, tmp_path / "b", verify_keys=[other, public])  # rotation: either key

    signed = json.loads(release.read_text())
    altered = json.loads(json.dumps(signed))
    altered["engines"][0]["files"][next(iter(altered["engines"][0]["files"]))]["sha256"] = "0" * 64
    release.write_text(json.dumps(altered))
    with pytest.raises(SignatureError, match=r"the signature does not verify"):
        stage.package_stage(config, tmp_path / "c", verify_keys=[public])
    release.write_text(json.dumps({k: v for k, v in signed.items() if k != "signature"}))
    with pytest.raises(SignatureError, match=r"is not signed"):
        stage.package_stage(config, tmp_path / "d", verify_keys=[public])


def test_build_trust_signed_on_a_file_workspace_requires_verify(workspace):
    config, public, tmp_path = workspace
    data = yaml.safe_load(config.read_text())
    data["build"]["workspace"] = (config.parent / "build").resolve().as_uri()  # file:// shared directory
    data["build"]["trust"] = "signed"
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(SignatureError, match=r"build.trust is signed: give the release's public key with --verify"):
        stage.package_stage(config, tmp_path / "a")
    with pytest.raises(SignatureError, match=r"serves only a signed repository; package on the release host with "
                       r"--sign KEY too"):
        stage.package_stage(config, tmp_path / "unsigned", verify_keys=[public])  # no serve could take it
    out = tmp_path / "b"
    stage.package_stage(config, out, verify_keys=[public], sign_key=tmp_path / "keys" / "release.pem")
    with pytest.raises(SignatureError, match=r"build.trust: signed; serve it with --verify"):
        stage.start(out)
