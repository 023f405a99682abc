"""`serve --verify`: a packaged Triton repository checked against its signed repository manifest and the signed
engine release copied into it."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path, PurePath

from ..signing import RELEASE_FILE, SignatureError, covered_files, read_release, verify_release
from .sealed_repository import check_repository


def verify_repository(repo: str | os.PathLike, public_keys: Sequence[str | os.PathLike]) -> None:
    """The repository in place: every file exactly as its signed repository manifest lists
    (sealed_repository.check_repository), then the engine models against the signed engine release
    (`verify_engine_models`). `serve --verify` runs the same checks on its private copy instead."""
    check_repository(repo, public_keys)
    verify_engine_models(repo, public_keys)


def verify_engine_models(repo: str | os.PathLike, public_keys: Sequence[str | os.PathLike]) -> None:
    """The repository's copy of the signed engine release verifies, and every engine model's version folder
    holds only files the release lists for its engine key (by name, sha256 checked), the python-backend wrapper
    package writes, and an OpenVINO compiled blob its covered manifest names; every pipeline model's `model.py`
    is the one package writes. (The repository's own files — configs, tokenizers, code — are covered by the
    signed repository manifest: sealed_repository.py.)"""
    from ..workspace.files import sha256_file
    from .configs import ROLE
    from .repository import ENGINE_MODEL_PY, PIPELINE_MODEL_PY, VERSION
    from .validate import read_configs

    repo = Path(repo)
    release_path = repo / RELEASE_FILE
    payload = verify_release(read_release(release_path), public_keys, where=str(release_path))
    covered = covered_files(payload, str(release_path))
    engines = 0
    for name, config in read_configs(repo).items():
        parameters = config.parameters
        role = parameters[ROLE].string_value if ROLE in parameters else ""
        if role in ("entry", "stream", "stage"):  # the code a pipeline model runs is the code package writes
            code = repo / name / VERSION / "model.py"
            if not code.is_file() or code.is_symlink() or code.read_text(errors="replace") != PIPELINE_MODEL_PY:
                raise SignatureError(f"model {name}: {VERSION}/model.py is not the pipeline model package writes")
        if role != "engine":
            continue
        engines += 1
        key = parameters["engine_key"].string_value if "engine_key" in parameters else ""
        files = covered.get(key)
        if files is None:
            raise SignatureError(f"model {name}: its engine {key or '(no engine_key)'} is not in the signed release")
        by_name = {PurePath(relative).name: digest for relative, digest in files.items()}
        version = repo / name / VERSION
        allowed_blob = _covered_blob(version, by_name)
        for path in sorted(version.rglob("*")):
            if path.is_symlink():
                raise SignatureError(f"model {name}: {path} is a symbolic link")
            if not path.is_file():
                continue
            relative = path.relative_to(version).as_posix()
            if relative == "model.py" and path.read_text(errors="replace") == ENGINE_MODEL_PY:
                continue
            if relative == allowed_blob:
                continue  # OpenVINO checks its compiled blob against the (covered) IR and recompiles a bad one
            if relative not in by_name:
                raise SignatureError(f"model {name}: {relative} is not covered by the signed release")
            if sha256_file(path) != by_name[relative]:
                raise SignatureError(f"model {name}: {relative} differs from the signed release (sha256)")
    if not engines:
        raise SignatureError(f"{repo} holds no engine models to verify")


def _covered_blob(version: Path, by_name: dict[str, str]) -> str | None:
    from ..workspace.files import sha256_file

    manifest = version / "manifest.json"
    if "manifest.json" not in by_name or not manifest.is_file() or sha256_file(manifest) != by_name["manifest.json"]:
        return None
    try:
        blob = json.loads(manifest.read_text()).get("cache_blob")
    except (ValueError, AttributeError):
        return None
    return blob if isinstance(blob, str) and "/" not in blob and blob.endswith(".blob") else None

