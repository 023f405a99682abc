"""Signed releases: ed25519 (through `cryptography`) over the release manifest, and the checks that refuse
anything a signed release does not cover.

A shared workspace lets anyone who can write it rewrite an engine *and* its manifest's sha256 (an unkeyed
seal). A signature made on the release host, after `trt-diffusion manifest` verified every engine, is what a
packaging or serving host can trust instead: `package --verify PUBKEY` refuses an engine whose files are not
exactly those the signed release lists, and `serve --verify PUBKEY` refuses a repository whose engine files
are not (triton/release_check.py; see docs/security.md).

- `generate_keys(private, public)`: a private PEM (PKCS#8, mode 0600) and a public PEM; the key id is the
  sha256 of the raw 32-byte public key.
- `sign_release(manifest, private)`: the manifest with a `signature` block {algorithm, key_id, value}; the
  signed bytes are the canonical JSON of the manifest without that block.
- `verify_release(release, public_keys)`: the manifest once its signature verifies under one of the keys
  (several keys: rotation).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .errors import ConfigError, ServeError
from .workspace.safe_paths import checked_relative

ALGORITHM = "ed25519"
RELEASE_FILE = "release-manifest.json"
TRUST_LEVELS = ("manifest", "signed")  # build.trust: what package/serve require of an engine


class SignatureError(ServeError):
    """A release manifest is unsigned, signed by an unknown key, altered, or does not cover an engine."""


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:  # a dependency: only a broken install gets here
        raise ConfigError("signing needs the cryptography package (pip install cryptography)") from None
    return ed25519, serialization, InvalidSignature


def canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def key_id(public_key) -> str:
    _, serialization, _ = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def generate_keys(private_path: str | os.PathLike, public_path: str | os.PathLike | None = None) -> tuple[Path, Path, str]:
    """Write a new ed25519 key pair: (private PEM, public PEM, key id). Never overwrites a file."""
    ed25519, serialization, _ = _crypto()
    private_path = Path(private_path)
    public_path = Path(public_path) if public_path else private_path.with_name(private_path.stem + ".pub.pem")
    for path in (private_path, public_path):
        if os.path.lexists(path):
            raise ConfigError(f"{path} already exists; refusing to overwrite a key")
    key = ed25519.Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    private_path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(private_pem)
    public_path.parent.mkdir(parents=True, exist_ok=True)
    with open(public_path, "xb") as handle:
        handle.write(public_pem)
    return private_path, public_path, key_id(key.public_key())


def load_private_key(path: str | os.PathLike):
    ed25519, serialization, _ = _crypto()
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: not a readable unencrypted private key PEM ({exc})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ConfigError(f"{path}: not an ed25519 private key (trt-diffusion keys generate makes one)")
    return key


def load_public_key(path: str | os.PathLike):
    ed25519, serialization, _ = _crypto()
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: not a readable public key PEM ({exc})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ConfigError(f"{path}: not an ed25519 public key")
    return key


def sign_release(manifest: dict, private_key_path: str | os.PathLike) -> dict:
    """`manifest` (what `trt-diffusion manifest` wrote) signed. Refused unless it was made with verification
    and every engine is `ok`: the release host signs only what it checked."""
    if not manifest.get("verified"):
        raise SignatureError("the release manifest was made without verification (--no-verify); make it again "
                             "with verification before signing")
    bad = [f"{e.get('name')} ({e.get('status')})" for e in manifest.get("engines", []) if e.get("status") != "ok"]
    if bad:
        raise SignatureError(f"{len(bad)} engine(s) of the release are not verified ok: {', '.join(bad[:4])}; "
                             "rebuild or remove them before signing")
    if not manifest.get("engines"):
        raise SignatureError("the release manifest lists no engines; nothing to sign")
    return sign_document(manifest, private_key_path)


def sign_document(document: dict, private_key_path: str | os.PathLike) -> dict:
    """`document` with a `signature` block over the canonical JSON of the rest (a release manifest, or the
    repository manifest of triton/sealed_repository.py)."""
    key = load_private_key(private_key_path)
    payload = {k: v for k, v in document.items() if k not in ("signature", "path")}
    value = key.sign(canonical(payload))
    return {**payload, "signature": {"algorithm": ALGORITHM, "key_id": key_id(key.public_key()),
                                     "value": base64.b64encode(value).decode()}}


def sign_release_file(path: str | os.PathLike, private_key_path: str | os.PathLike) -> dict:
    """Sign the release manifest at `path` in place (written atomically); the signed manifest."""
    from .workspace.files import atomic_write_bytes

    signed = sign_release(read_release(path), private_key_path)
    atomic_write_bytes(Path(path), json.dumps(signed, indent=2).encode())
    return signed


def read_release(path: str | os.PathLike) -> dict:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SignatureError(f"cannot read the release manifest {path} ({exc}); make it with `trt-diffusion "
                             "manifest` and sign it with --sign") from None
    if len(data) > 64 << 20:
        raise SignatureError(f"{path}: {len(data)} bytes is not a release manifest")
    try:
        release = json.loads(data)
    except (ValueError, RecursionError):
        raise SignatureError(f"{path}: not JSON") from None
    if not isinstance(release, dict):
        raise SignatureError(f"{path}: not a JSON object")
    return release


def verify_release(release: dict, public_keys: Sequence[str | os.PathLike], *, where: str = "the release") -> dict:
    """The release's payload once its signature verifies under one of `public_keys`; SignatureError naming
    what is wrong otherwise."""
    _, _, invalid_signature = _crypto()
    if not public_keys:
        raise SignatureError(f"{where}: no public key to verify it with (--verify PUBKEY)")
    signature = release.get("signature")
    if not isinstance(signature, dict):
        raise SignatureError(f"{where} is not signed (sign it on the release host: trt-diffusion manifest --sign KEY)")
    if signature.get("algorithm") != ALGORITHM:
        raise SignatureError(f"{where}: signature algorithm {signature.get('algorithm')!r}, expected {ALGORITHM}")
    keys = {key_id(k): k for k in (load_public_key(p) for p in public_keys)}
    wanted = signature.get("key_id")
    if wanted not in keys:
        raise SignatureError(f"{where} is signed by key {str(wanted)[:16]}…, not by any key given to --verify "
                             f"({', '.join(k[:16] + '…' for k in keys)})")
    try:
        value = base64.b64decode(str(signature.get("value", "")), validate=True)
    except ValueError:
        raise SignatureError(f"{where}: the signature is not base64") from None
    payload = {k: v for k, v in release.items() if k != "signature"}
    try:
        keys[wanted].verify(value, canonical(payload))
    except invalid_signature:
        raise SignatureError(f"{where}: the signature does not verify: the manifest was altered after it was "
                             "signed") from None
    return payload


def covered_files(payload: dict, where: str = "the release") -> dict[str, dict[str, str]]:
    """engine key -> {workspace-relative path: sha256} of every `ok` engine a verified release lists."""
    covered: dict[str, dict[str, str]] = {}
    for entry in payload.get("engines") or []:
        if not isinstance(entry, dict) or entry.get("status") != "ok" or not isinstance(entry.get("files"), dict):
            continue
        files = {}
        for relative, record in entry["files"].items():
            checked_relative(relative, where=where, field="files", error=SignatureError)
            files[relative] = record.get("sha256") if isinstance(record, dict) else None
        covered[str(entry.get("key"))] = files
    return covered


def verify_engines(engines: Iterable[Any], workspace: str | os.PathLike, release_path: str | os.PathLike,
                   public_keys: Sequence[str | os.PathLike]) -> dict:
    """Refuse (SignatureError naming the engine and file) any engine whose files are not exactly those the
    signed release lists with their sha256 (each file read in full); the verified release payload."""
    from .workspace.files import sha256_file
    from .workspace.provenance import engine_files

    payload = verify_release(read_release(release_path), public_keys, where=str(release_path))
    covered = covered_files(payload, str(release_path))
    root = Path(workspace)
    for engine in engines:
        name = engine.spec.name
        files = covered.get(engine.spec.key)
        if files is None:
            raise SignatureError(f"engine {name} ({engine.spec.key}) is not in the signed release {release_path}")
        found = {Path(os.path.relpath(f, root)).as_posix(): f for f in engine_files(Path(engine.path))}
        for relative, path in sorted(found.items()):
            if relative not in files:
                raise SignatureError(f"engine {name}: {relative} is not covered by the signed release")
            if sha256_file(path) != files[relative]:
                raise SignatureError(f"engine {name}: {relative} differs from the signed release (sha256)")
        missing = sorted(set(files) - set(found))
        if missing:
            raise SignatureError(f"engine {name}: {missing[0]} of the signed release is missing")
    return payload


def verify_workspace(release_path: str | os.PathLike, workspace: str | os.PathLike,
                     public_keys: Sequence[str | os.PathLike]) -> tuple[dict, list[str]]:
    """`manifest --verify PUBKEY`: the signed release at `release_path` verifies, and every file it lists is in
    `workspace` with that sha256. (payload, problems), problems naming engine and file; SignatureError when the
    signature itself does not verify."""
    from .workspace.files import sha256_file
    from .workspace.safe_paths import inside_folder

    payload = verify_release(read_release(release_path), public_keys, where=str(release_path))
    problems = []
    for entry in payload.get("engines") or []:
        name = entry.get("name") if isinstance(entry, dict) else None
        for relative, digest in covered_files({"engines": [entry]}, str(release_path)).get(str(entry.get("key")),
                                                                                              {}).items():
            path = inside_folder(workspace, relative, where=str(release_path), field="files", error=SignatureError)
            if not path.is_file():
                problems.append(f"{name}: {relative} is missing")
            elif sha256_file(path) != digest:
                problems.append(f"{name}: {relative} differs from the signed release (sha256)")
    return payload, problems
