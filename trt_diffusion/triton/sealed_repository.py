"""A signed Triton repository: every file `package` wrote, sealed by the release key, and served only from a
private verified copy (issue 44, findings 1 and 2).

The engine-level release (signing.py) covers the engines' files. A repository also holds code and settings that
run in the server: each model's `config.pbtxt` (`default_model_filename`, the python backend's
`EXECUTION_ENV_PATH`…), `model.py`, the pipeline models' configs and tokenizers, the package report. So the
release host signs the packaged repository too (`package --sign KEY`): `repository-manifest.json` lists every
file with its sha256 (schema 2). `serve --verify PUBKEY` then

1. verifies that signature and refuses any file in the repository the manifest does not list (a planted
   `1/evil.py`, a symbolic link) and any listed file that is missing;
2. copies exactly the listed files into a private 0700 folder of its own (a reflink where the filesystem
   allows: no extra disk until a file is changed; else a full copy), hashing what it writes;
3. refuses the copy if a single byte differs from the manifest, and starts tritonserver on the copy.

What is verified is what runs: whoever can write the published repository can change it after step 3, and the
server never reads it again (the verify-then-load race of the finding).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from .. import signing
from ..signing import SignatureError
from ..workspace.safe_paths import checked_relative

REPOSITORY_MANIFEST = "repository-manifest.json"
SCHEMA_VERSION = 2  # 1: a release covered the engines only (the repository's own files were trusted unchecked)
KIND = "triton-repository"
VERIFIED_COPY = "verified-repository"  # the private copy's folder in the server's work folder
_FICLONE = 0x40049409  # linux/fs.h: share the source's extents (btrfs, XFS with reflink, overlayfs on those)
_CHUNK = 1 << 20
# Python's bytecode cache: the python backend writes it beside each model.py it imports (PYTHONDONTWRITEBYTECODE
# does not reach the stub), so a release host's smoke test of the repository leaves it there
BYTECODE = "__pycache__"


def repository_files(repo: Path) -> tuple[dict[str, Path], list[str]]:
    """Every regular file under `repo` (its repository manifest and Python's `__pycache__` folders aside) by
    relative POSIX name, and every folder (an ensemble's version folder is empty, and Triton needs it); a symbolic
    link, or anything else that is not a file or a folder, is refused (SignatureError naming it)."""
    found: dict[str, Path] = {}
    folders: list[str] = []
    for path in sorted(repo.rglob("*")):
        relative = path.relative_to(repo).as_posix()
        if BYTECODE in path.relative_to(repo).parts:
            continue  # what a plain `serve` of this folder compiled: never copied, so never run by `serve --verify`
        if path.is_symlink():
            raise SignatureError(f"{repo}: {relative} is a symbolic link; a signed repository holds only files")
        if path.is_dir():
            folders.append(relative)
        elif not path.is_file():
            raise SignatureError(f"{repo}: {relative} is not a regular file")
        elif relative != REPOSITORY_MANIFEST:
            found[relative] = path
    return found, folders


def seal_repository(repo: str | os.PathLike, private_key: str | os.PathLike) -> dict:
    """Sign every file of the packaged repository `repo` (on the release host, right after `package`): writes
    `repo/repository-manifest.json` atomically; the signed manifest."""
    from ..workspace.files import atomic_write_bytes, sha256_file

    repo = Path(repo)
    found, folders = repository_files(repo)
    files = {relative: sha256_file(path) for relative, path in found.items()}
    if not files:
        raise SignatureError(f"{repo} is empty: package a repository before signing it")
    signed = signing.sign_document({"schema_version": SCHEMA_VERSION, "kind": KIND, "files": files,
                                    "folders": folders}, private_key)
    atomic_write_bytes(repo / REPOSITORY_MANIFEST, json.dumps(signed, indent=2).encode())
    return signed


def signed_files(repo: Path, public_keys: Sequence[str | os.PathLike]) -> tuple[dict[str, str], list[str]]:
    """(relative name -> sha256 of every file, every folder) the repository's signed manifest lists, once its
    signature verifies under one of `public_keys`; a repository signed the old way (engines only) is refused with
    what to do."""
    path = repo / REPOSITORY_MANIFEST
    if not path.is_file() or path.is_symlink():
        older = " (it holds an engines-only release of schema 1, which does not cover the models' code and configs)" \
            if (repo / signing.RELEASE_FILE).is_file() else ""
        raise SignatureError(f"{repo} has no signed {REPOSITORY_MANIFEST}{older}: package it again on the release "
                             "host and sign the repository: trt-diffusion package engines.yaml --verify PUBKEY "
                             "--sign KEY (docs/security.md)")
    payload = signing.verify_release(signing.read_release(path), public_keys, where=str(path))
    if payload.get("kind") != KIND or payload.get("schema_version") != SCHEMA_VERSION:
        raise SignatureError(f"{path}: kind {payload.get('kind')!r}, schema_version {payload.get('schema_version')!r}; "
                             f"this trt-diffusion serves {KIND} schema {SCHEMA_VERSION}: package and sign it again")
    files = payload.get("files")
    if not isinstance(files, dict) or not files:
        raise SignatureError(f"{path}: lists no files")
    for relative, digest in files.items():
        checked_relative(relative, where=str(path), field="files", error=SignatureError)
        if not isinstance(digest, str) or len(digest) != 64:
            raise SignatureError(f"{path}: files.{relative} is not a sha256")
    folders = payload.get("folders")
    if not isinstance(folders, list) or not all(isinstance(folder, str) for folder in folders):
        raise SignatureError(f"{path}: folders is not a list of names")
    for folder in folders:
        checked_relative(folder, where=str(path), field="folders", error=SignatureError)
    return files, folders


def check_repository(repo: str | os.PathLike, public_keys: Sequence[str | os.PathLike]) -> dict[str, str]:
    """The repository in place holds exactly the files its signed manifest lists, each with its sha256 (no copy:
    what `serve --verify` checks before copying, and a check a release pipeline can run on its own)."""
    from ..workspace.files import sha256_file

    repo = Path(repo)
    files, folders = signed_files(repo, public_keys)
    present = _matching_layout(repo, files, folders)
    for relative, digest in files.items():
        if sha256_file(present[relative]) != digest:
            raise SignatureError(f"{repo}: {relative} differs from the signed repository (sha256)")
    return files


def verified_copy(repo: str | os.PathLike, public_keys: Sequence[str | os.PathLike], into: str | os.PathLike) -> Path:
    """A private copy (0700, in `into`) of the signed repository, every byte of it checked against the signed
    manifest: the folder tritonserver is then started on. Raises SignatureError, leaving no copy, otherwise."""
    repo = Path(repo)
    files, folders = signed_files(repo, public_keys)
    present = _matching_layout(repo, files, folders)
    Path(into).mkdir(mode=0o700, parents=True, exist_ok=True)
    copy = Path(into) / VERIFIED_COPY
    if copy.is_symlink() or copy.is_file():
        copy.unlink()
    elif copy.exists():
        shutil.rmtree(copy)  # the work folder is ours: a copy left by an earlier start
    os.mkdir(copy, 0o700)  # fails if someone made it in between: nothing is copied into a folder we did not make
    try:
        for folder in sorted(folders, key=lambda name: name.count("/")):  # parents first
            os.mkdir(copy / folder, 0o700)
        for relative, digest in files.items():
            target = copy / relative
            if _copy_hashed(present[relative], target) != digest:
                raise SignatureError(f"{repo}: {relative} differs from the signed repository (sha256)")
    except BaseException:
        shutil.rmtree(copy, ignore_errors=True)
        raise
    return copy


def _matching_layout(repo: Path, files: dict[str, str], folders: list[str]) -> dict[str, Path]:
    """The repository's files, once they and its folders are exactly the signed ones by name (none more, none
    less: Triton loads a model from any folder at the top)."""
    present, present_folders = repository_files(repo)
    extra = sorted(set(present) - set(files)) + sorted(set(present_folders) - set(folders))
    if extra:
        raise SignatureError(f"{repo}: {extra[0]} is not covered by the signed repository"
                             + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "") +
                             "; serve --verify runs only what the release host signed")
    missing = sorted(set(files) - set(present)) + sorted(set(folders) - set(present_folders))
    if missing:
        raise SignatureError(f"{repo}: {missing[0]} of the signed repository is missing")
    return present


def _copy_hashed(source: Path, target: Path) -> str:
    """Copy `source` to a new private file `target`; the sha256 of the bytes `target` holds. A reflink is tried
    first (the copy is then hashed from `target` itself); else the bytes are hashed as they are written."""
    digest = hashlib.sha256()
    with open(source, "rb") as reader:
        descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "wb") as writer:
            if _reflink(reader.fileno(), writer.fileno()):
                writer.flush()
                with open(target, "rb") as copied:
                    while chunk := copied.read(_CHUNK):
                        digest.update(chunk)
                return digest.hexdigest()
            while chunk := reader.read(_CHUNK):
                digest.update(chunk)
                writer.write(chunk)
    return digest.hexdigest()


def _reflink(source_fd: int, target_fd: int) -> bool:
    try:
        fcntl.ioctl(target_fd, _FICLONE, source_fd)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM):
            return False  # this filesystem (or a cross-device pair) cannot share extents: copy the bytes
        raise
    return True
