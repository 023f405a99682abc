"""A signed repository covers every file `package` writes, and `serve --verify` serves a verified private copy
(issue 44, findings 1 and 2). Before: `serve --verify` checked the engine models' version folders and the
pipeline models' `model.py` only, so a `default_model_filename: "evil.py"` line in a pipeline model's
config.pbtxt plus `1/evil.py` verified and ran; and it verified the repository in place, then tritonserver read
it again later. Real engines (the session's tiny sd15 build), real keys; the served cases are in
tests/triton/test_verified_serving.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from trt_diffusion import signing
from trt_diffusion.cli import main
from trt_diffusion.signing import SignatureError
from trt_diffusion.triton import stage
from trt_diffusion.triton.release_check import verify_repository
from trt_diffusion.triton.sealed_repository import REPOSITORY_MANIFEST, check_repository, verified_copy


@pytest.fixture(scope="module")
def release(sealed_sd15):
    return sealed_sd15.config, sealed_sd15.private_key, sealed_sd15.public_key, sealed_sd15.repo


@pytest.fixture
def repo(release, tmp_path):
    """A fresh copy of the sealed repository for a test to tamper with (files copied, not linked)."""
    copy = tmp_path / "repo"
    shutil.copytree(release[3], copy)
    return copy


def _pipeline_model(repo):
    return next(p.parent.parent for p in repo.glob("*/1/model.py") if "pipeline_model" in p.read_text())


def test_the_seal_lists_every_file_package_wrote(release):
    _, _, public, repo = release
    files = check_repository(repo, [public])
    written = {p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file()} - {REPOSITORY_MANIFEST}
    assert set(files) == written
    pipeline = _pipeline_model(repo).name
    assert f"{pipeline}/config.pbtxt" in files and f"{pipeline}/1/model.py" in files
    assert any(name.startswith(pipeline) and "tokenizer" in name for name in files)  # copied model files too
    assert signing.RELEASE_FILE in files
    verify_repository(repo, [public])


def test_a_planted_config_line_and_its_file_are_refused(repo, release):
    public = release[2]
    pipeline = _pipeline_model(repo)
    config = pipeline / "config.pbtxt"
    config.write_text(config.read_text() + '\ndefault_model_filename: "evil.py"\n')
    with pytest.raises(SignatureError, match=rf"{pipeline.name}/config.pbtxt differs from the signed repository"):
        verify_repository(repo, [public])
    with pytest.raises(SignatureError, match=r"config.pbtxt differs"):
        verified_copy(repo, [public], repo.parent / "work")
    assert not (repo.parent / "work" / "verified-repository").exists()  # a refused copy leaves nothing


def test_a_file_the_seal_does_not_list_is_refused(repo, release):
    public = release[2]
    planted = _pipeline_model(repo) / "1" / "evil.py"
    planted.write_text("import os\nos.system('touch /tmp/pwned')\n")
    with pytest.raises(SignatureError, match=r"1/evil.py is not covered by the signed repository"):
        check_repository(repo, [public])
    planted.unlink()
    (repo / "planted_model").mkdir()  # Triton would try to load a model from any folder at the top
    with pytest.raises(SignatureError, match=r"planted_model is not covered by the signed repository"):
        check_repository(repo, [public])
    (repo / "planted_model").rmdir()
    tokenizer = next(p for p in _pipeline_model(repo).rglob("*") if p.is_file() and "tokenizer" in p.as_posix())
    tokenizer.write_bytes(tokenizer.read_bytes() + b" ")
    with pytest.raises(SignatureError, match=r"differs from the signed repository"):
        check_repository(repo, [public])


def test_links_missing_files_other_keys_and_old_releases_are_refused(repo, release, tmp_path):
    config, private, public, _ = release
    code = _pipeline_model(repo) / "1" / "model.py"
    saved = code.read_bytes()
    code.unlink()
    with pytest.raises(SignatureError, match=r"1/model.py of the signed repository is missing"):
        check_repository(repo, [public])
    os.symlink(tmp_path / "elsewhere.py", code)
    with pytest.raises(SignatureError, match=r"1/model.py is a symbolic link"):
        check_repository(repo, [public])
    code.unlink()
    code.write_bytes(saved)
    check_repository(repo, [public])

    _, other, _ = signing.generate_keys(tmp_path / "other.pem")
    with pytest.raises(SignatureError, match=r"not by any key given to --verify"):
        check_repository(repo, [other])
    manifest = repo / REPOSITORY_MANIFEST
    altered = json.loads(manifest.read_text())
    altered["files"][f"{_pipeline_model(repo).name}/1/evil.py"] = "0" * 64
    manifest.write_text(json.dumps(altered))
    with pytest.raises(SignatureError, match=r"the signature does not verify"):
        check_repository(repo, [public])

    # a repository packaged with --verify alone (the engines-only release of schema 1): refused, with what to do
    old = tmp_path / "old"
    stage.package_stage(config, old, verify_keys=[public])
    with pytest.raises(SignatureError, match=r"engines-only release of schema 1.*--sign KEY"):
        verified_copy(old, [public], tmp_path / "work")
    with pytest.raises(SignatureError, match=r"--sign seals a repository of verified engines only"):
        stage.package_stage(config, tmp_path / "unverified", sign_key=private)


def test_bytecode_a_plain_serve_compiled_is_neither_refused_nor_copied(repo, release, tmp_path):
    """A smoke test of the published folder with plain `serve` leaves `1/__pycache__/*.pyc` (the python backend
    writes it whatever PYTHONDONTWRITEBYTECODE says): a later `serve --verify` must still serve it, and the copy
    must not hold a byte of it."""
    public = release[2]
    cache = _pipeline_model(repo) / "1" / "__pycache__"
    cache.mkdir()
    (cache / "model.cpython-311.pyc").write_bytes(b"planted bytecode")
    check_repository(repo, [public])
    copy = verified_copy(repo, [public], tmp_path / "work")
    assert not any("__pycache__" in p.parts for p in copy.rglob("*"))


def test_the_verified_copy_is_private_and_unmoved_by_later_changes(repo, release, tmp_path):
    public = release[2]
    copy = verified_copy(repo, [public], tmp_path / "work")
    assert copy.stat().st_mode & 0o777 == 0o700
    assert not (copy / REPOSITORY_MANIFEST).exists()  # only the signed files: the copy is what was verified
    signed = check_repository(repo, [public])
    assert {p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()} == set(signed)
    assert {p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_dir()} == \
        {p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_dir()}  # an ensemble's empty 1/ too
    # the race of finding 2: the published repository changes after the check; the copy does not
    engine = next(p for p in repo.glob("*/1/model.onnx*") if p.stat().st_size > 1000)
    before = (copy / engine.relative_to(repo)).read_bytes()
    replacement = engine.with_name(engine.name + ".new")
    replacement.write_bytes(bytes(b ^ 0xFF for b in engine.read_bytes()))
    os.replace(replacement, engine)
    assert (copy / engine.relative_to(repo)).read_bytes() == before
    # a later start replaces the copy it left, and checks again
    with pytest.raises(SignatureError, match=r"differs from the signed repository"):
        verified_copy(repo, [public], tmp_path / "work")


def test_package_sign_and_serve_verify_through_the_cli(release, tmp_path, capsys):
    config, private, public, _ = release
    out = tmp_path / "cli-repo"
    assert main(["package", str(config), "--out", str(out), "--verify", str(public), "--sign", str(private)]) == 0
    check_repository(out, [public])
    (_pipeline_model(out) / "1" / "evil.py").write_text("raise SystemExit\n")
    capsys.readouterr()
    assert main(["serve", "--repo", str(out), "--verify", str(public), "--no-first-request"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "evil.py is not covered by the signed repository" in err and "Traceback" not in err
