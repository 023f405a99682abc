"""A workspace at a URL: an object store (`s3://bucket/prefix`, `gs://…`, any fsspec backend) shared by build
hosts, serving hosts and CI shards.

Every stage keeps working on a local folder — the *cache* of the URL (`build.cache`, else
`$TRT_DIFFUSION_CACHE/<hash of the URL>`, else `~/.cache/trt-diffusion/<hash of the URL>`) — holding the usual
content-addressed layout (`onnx/<name>.<key>/`, `engines/<target>/<name>.<key>…`, `provenance/<key>.json`).
The store is synchronised with it in *units*: an artifact folder (or an engine's files) and its provenance.

Layout at the URL:

    blobs/sha256/<ab>/<sha256>          file contents, content-addressed: written once, never changed
    index/<unit>.json                   a unit's record: every file (path in the workspace, sha256, bytes)
    locks/<key>.lock                    who is building an engine key (heartbeat inside; expires)
    tmp/<random>                        uploads in flight

*Publish* uploads each file as a blob (under a temporary key, then moved into place; a blob already there is
content-addressed, so it is the same bytes) and writes the record last, in one put: a reader sees either the
old record or the new one, and every blob either names is complete. Two hosts publishing one unit write
their own blobs and one record each; whichever record lands last wins, and it is whole. *Pull* reads the
record and downloads only the files it names, each verified against its sha256 before it is put in place
(an artifact's own manifest last), so nothing the store did not vouch for is trusted.

Credentials come from the backend's usual sources (for S3: the AWS_* environment, ~/.aws, instance roles;
fsspec's `FSSPEC_S3_*` variables, e.g. `FSSPEC_S3_ENDPOINT_URL`), never from engines.yaml, and URLs are
shown masked (urls.py: what a `build.workspace` value is, and the local folder it maps to). A `file://` URL or
a plain path is a shared directory used as the workspace itself: no store, and the per-engine lock files of
locks.py work there as is. What the stages call around this store (pull before, publish after, the lock of a
key across hosts) is store_sync.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import ConfigError, MissingDependencyError, TrtDiffusionError
from ..extras import install_line
from .files import sha256_file
from .locks import heartbeat
from .urls import mask_url

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
INSTALL_HINT = f"install the store extra: {install_line('store')}"
SOURCE_KINDS = ("onnx", "quantized", "calibration")  # artifacts engines are built from (store.py folders)
LOCK_STALE_AFTER_S = 600.0  # a remote lock nobody has touched for this long belongs to a dead builder
LOCK_HEARTBEAT_S = 10.0
LOCK_POLL_S = 0.5
CLOCK_SKEW_S = 120.0  # a lock touched further in the future than this is not a heartbeat: it is stale
STATE_FILE = ".store-state.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_RECORD_BYTES = 16 << 20  # a record lists files: far below this


class StoreError(TrtDiffusionError):
    """The artifact store at build.workspace cannot be reached, or holds something its records do not vouch for."""


# --- the store ----------------------------------------------------------------------------------


def _is_manifest(relative: str) -> bool:
    return relative.rsplit("/", 1)[-1].endswith("manifest.json")


def _host() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid()}


class RemoteStore:
    """The store at `url`, mirrored into the local folder `cache`."""

    def __init__(self, url: str, cache: Path, storage_options: dict | None = None):
        self.url, self.shown = url.rstrip("/"), mask_url(url).rstrip("/")
        self.cache = Path(cache)
        self.fs, self.root = _filesystem(url, storage_options or {})
        self.root = self.root.rstrip("/")
        self._state_lock = threading.Lock()

    # keys
    def _key(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def blob_key(self, sha256: str) -> str:
        return self._key("blobs", "sha256", sha256[:2], sha256)

    def index_key(self, unit: str) -> str:
        return self._key("index", f"{unit}.json")

    def lock_key(self, key: str) -> str:
        return self._key("locks", f"{key}.lock")

    # --- records ------------------------------------------------------------------------------

    def units(self, prefix: str = "") -> list[str]:
        """Every unit the store holds a record of (optionally only those under `prefix`)."""
        base = self._key("index")
        self.fs.invalidate_cache()  # other hosts publish: a cached listing would hide their records
        try:
            keys = self.fs.find(f"{base}/{prefix}".rstrip("/"))
        except FileNotFoundError:
            return []
        except Exception as exc:  # noqa: BLE001 - the backend's own error kinds vary
            raise self._error("list", exc) from None
        units = []
        for key in keys:
            relative = key[len(base) + 1:] if key.startswith(base + "/") else key.split("/index/", 1)[-1]
            if relative.endswith(".json"):
                units.append(relative[: -len(".json")])
        return sorted(units)

    def record(self, unit: str) -> dict | None:
        try:
            data = self.fs.cat_file(self.index_key(unit))
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise self._error(f"read the record of {unit}", exc) from None
        if len(data) > _MAX_RECORD_BYTES:
            raise StoreError(f"{self.shown}: the record of {unit} is {len(data)} bytes, not a record; publish it again")
        try:
            record = json.loads(data)
        except (ValueError, RecursionError):
            raise StoreError(f"{self.shown}: the record of {unit} is not JSON; publish it again") from None
        if not isinstance(record, dict):
            raise StoreError(f"{self.shown}: the record of {unit} is not a JSON object; publish it again")
        if record.get("schema_version") != SCHEMA_VERSION or record.get("unit") != unit:
            raise StoreError(f"{self.shown}: the record of {unit} is of another schema or unit")
        self.check_record(unit, record)
        return record

    def check_record(self, unit: str, record: dict) -> None:
        """StoreError unless every file the record names is a well-formed entry inside its own unit: a unit's
        folder (`onnx/<name>.<key>/…`, `engines/<target>/<name>.<key>/…`), a plan's same-stem siblings, and
        the provenance record of its key. Another unit's files, the cache's own state files, locks and hidden
        names are refused, so one host's record can only ever write its own unit."""
        where = f"{self.shown}: the record of {unit}"
        files = record.get("files")
        if not isinstance(files, dict) or not files:
            raise StoreError(f"{where}: field 'files' is not a non-empty mapping; publish it again")
        for relative in files:
            self._local_path(relative, where)
        allowed = unit_paths(unit, record.get("key"), where)
        for relative, entry in files.items():
            if not allowed(relative):
                raise StoreError(f"{where}: field 'files' names {relative!r}, which is outside the unit {unit}; "
                                 "refusing the whole record")
            if (not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str)
                    or not _SHA256.fullmatch(entry["sha256"]) or type(entry.get("bytes")) is not int
                    or entry["bytes"] < 0):
                raise StoreError(f"{where}: the entry of {relative!r} is not {{sha256: 64 hex digits, bytes: an "
                                 "integer}; publish it again")

    def records(self, units: Iterable[str]) -> dict[str, dict]:
        found = {}
        for unit in units:
            record = self.record(unit)
            if record is not None:
                found[unit] = record
        return found

    # --- publish ------------------------------------------------------------------------------

    def publish(self, unit: str, files: Iterable[str | Path], *, key: str | None = None) -> bool:
        """Upload `files` (paths in the cache) as one unit; False when the store already records exactly them."""
        entries = {}
        for file in sorted({Path(f) for f in files}):
            relative = self._relative(file)
            entries[relative] = {"sha256": self._local_sha256(relative), "bytes": file.stat().st_size}
        if not entries:
            raise StoreError(f"unit {unit}: nothing to publish")
        current = self.record(unit)
        if current is not None and current.get("files") == entries:
            return False
        for relative, entry in entries.items():
            self._put_blob(self.cache / relative, entry["sha256"])
        record = {"schema_version": SCHEMA_VERSION, "unit": unit, "key": key, "files": entries,
                  "published_by": _host(), "published_at": datetime.now(UTC).isoformat(timespec="seconds")}
        self._put_atomically(self.index_key(unit), json.dumps(record, indent=2, sort_keys=True).encode())
        log.info("published %s to %s", unit, self.shown)
        return True

    def _remote_sha256(self, key: str) -> str:
        digest = hashlib.sha256()
        with self.fs.open(key, "rb") as handle:
            while block := handle.read(8 << 20):
                digest.update(block)
        return digest.hexdigest()

    def _put_blob(self, path: Path, sha256: str) -> None:
        final = self.blob_key(sha256)
        try:
            if (self.fs.exists(final) and self.fs.info(final).get("size") == path.stat().st_size
                    and self._remote_sha256(final) == sha256):
                return  # content-addressed, and verified: the same bytes are there (an overwritten blob is repaired)
            temp = self._key("tmp", f"{sha256}.{secrets.token_hex(6)}")
            self.fs.put_file(str(path), temp)
            self.fs.mv(temp, final)
        except Exception as exc:  # noqa: BLE001
            raise self._error(f"upload {path.name}", exc) from None

    def _put_atomically(self, key: str, data: bytes) -> None:
        temp = self._key("tmp", f"record.{secrets.token_hex(6)}")
        try:
            self.fs.pipe_file(temp, data)
            self.fs.mv(temp, key)
        except Exception as exc:  # noqa: BLE001
            raise self._error("write a record", exc) from None

    # --- pull ---------------------------------------------------------------------------------

    def pull(self, unit: str, record: dict | None = None) -> bool:
        """Make the cache hold exactly the files the unit's record names, each verified; False when it did."""
        if record is None:
            record = self.record(unit)
            if record is None:
                return False
        else:
            self.check_record(unit, record)
        wanted = {}
        for relative, entry in record["files"].items():
            self._local_path(relative)  # refuses a path that leaves the cache
            if not self._matches(relative, entry):
                wanted[relative] = entry
        if not wanted:
            return False
        staged: dict[str, Path] = {}
        try:
            for relative, entry in wanted.items():
                staged[relative] = self._download(unit, relative, entry)
            # the artifact's manifests go first out and last in: a pull cut short leaves it untrusted, not mixed
            order = sorted(staged, key=lambda r: (_is_manifest(r), r))
            for relative in order:
                if _is_manifest(relative):
                    self._local_path(relative).unlink(missing_ok=True)
            for relative in order:
                target = self._local_path(relative)
                os.replace(staged.pop(relative), target)
                self._remember(relative, wanted[relative]["sha256"])
        finally:
            for temp in staged.values():
                temp.unlink(missing_ok=True)
        log.info("pulled %s from %s (%d files)", unit, self.shown, len(wanted))
        return True

    def _download(self, unit: str, relative: str, entry: dict) -> Path:
        target = self._local_path(relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.with_name(f".{target.name}.pull.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            self.fs.get_file(self.blob_key(entry["sha256"]), str(temp))
        except FileNotFoundError:
            temp.unlink(missing_ok=True)
            raise StoreError(f"{self.shown}: {unit} names {relative}, whose content is not in the store; "
                             "publish it again (build on the host that made it)") from None
        except Exception as exc:  # noqa: BLE001
            temp.unlink(missing_ok=True)
            raise self._error(f"download {relative}", exc) from None
        digest = sha256_file(temp)
        if digest != entry["sha256"] or temp.stat().st_size != entry["bytes"]:
            temp.unlink(missing_ok=True)
            raise StoreError(f"{self.shown}: {relative} of {unit} came down with sha256 {digest[:12]}…, its record "
                             f"says {entry['sha256'][:12]}…: the store is damaged; nothing was put in the cache")
        return temp

    # --- the cache ----------------------------------------------------------------------------

    def _relative(self, path: Path) -> str:
        path = Path(os.path.abspath(path))
        base = Path(os.path.abspath(self.cache))
        if base not in path.parents:
            raise StoreError(f"{path} is not in the workspace cache {base}")
        return path.relative_to(base).as_posix()

    def _local_path(self, relative: str, where: str | None = None) -> Path:
        from .safe_paths import inside_folder

        where = where or f"{self.shown}: a record"
        try:
            return inside_folder(self.cache, relative, where=where, field="files", error=StoreError)
        except StoreError as exc:
            raise StoreError(f"{where} names {relative!r}, which is not a path in the workspace (a relative path "
                             "inside its unit: no absolute path, '..', empty or '.' part, or symbolic link)") from exc

    # A file is verified once; afterwards its (size, mtime) vouch for it until it changes.
    def _state(self) -> dict:
        try:
            return json.loads((self.cache / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def _remember(self, relative: str, sha256: str) -> None:
        path = self.cache / relative
        stat = path.stat()
        with self._state_lock:
            state = self._state()
            state[relative] = [sha256, stat.st_size, stat.st_mtime_ns]
            from .files import atomic_write_bytes

            atomic_write_bytes(self.cache / STATE_FILE, json.dumps(state).encode())

    def _local_sha256(self, relative: str) -> str:
        path = self.cache / relative
        stat = path.stat()
        known = self._state().get(relative)
        if known and known[1] == stat.st_size and known[2] == stat.st_mtime_ns:
            return known[0]
        digest = sha256_file(path)
        self._remember(relative, digest)
        return digest

    def _matches(self, relative: str, entry: dict) -> bool:
        path = self.cache / relative
        try:
            if path.stat().st_size != entry["bytes"]:
                return False
        except FileNotFoundError:
            return False
        return self._local_sha256(relative) == entry["sha256"]

    def _error(self, what: str, exc: Exception) -> StoreError:
        message = str(exc).replace(self.url, self.shown)
        return StoreError(f"{self.shown}: cannot {what}: {type(exc).__name__}: {message}")

    # --- locks --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, key: str, *, stale_after_s: float | None = None,
             heartbeat_s: float | None = None) -> Iterator[None]:
        """Hold the store's build lock of one engine key: one host builds a key at a time; a lock whose holder
        stopped its heartbeat `stale_after_s` ago (a dead builder) is broken. Advisory: what keeps the store
        whole is the publish protocol, so a broken lock's late holder can only cost a duplicate build."""
        stale_after_s = LOCK_STALE_AFTER_S if stale_after_s is None else stale_after_s
        heartbeat_s = LOCK_HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        path = self.lock_key(key)
        token = secrets.token_hex(8)
        waited = False
        while not self._create_lock(path, token):
            holder = self._read_lock(path)
            if holder is not None and _lock_is_stale(holder, stale_after_s):
                log.warning("breaking the stale lock of %s held by %s (dead, malformed, or no heartbeat for %s s)",
                            key, holder.get("host"), holder.get("touched"))
                self._break_lock(path, holder)
                continue
            if not waited:
                log.info("waiting for %s: %s is building it", key, (holder or {}).get("host", "another host"))
                waited = True
            time.sleep(LOCK_POLL_S)
        def touch() -> None:
            with contextlib.suppress(Exception):  # a store hiccup: keep beating
                self.fs.pipe_file(path, _lock_body(token))

        try:
            with heartbeat(touch, heartbeat_s, f"store-lock-{key}"):
                yield
        finally:
            holder = self._read_lock(path)
            if holder is not None and holder.get("token") == token:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(path)

    def _create_lock(self, path: str, token: str) -> bool:
        try:
            self.fs.pipe_file(path, _lock_body(token), mode="create")
            return True
        except FileExistsError:
            return False
        except Exception as exc:  # noqa: BLE001
            raise self._error("take a build lock", exc) from None

    def _read_lock(self, path: str) -> dict | None:
        try:
            holder = json.loads(self.fs.cat_file(path))
            return holder if isinstance(holder, dict) else {"touched": 0.0}  # not a lock body: it expires
        except FileNotFoundError:
            return None
        except (ValueError, RecursionError):
            return {"touched": 0.0}  # not ours to read: treat as untouched, it expires
        except Exception as exc:  # noqa: BLE001
            raise self._error("read a build lock", exc) from None

    def _break_lock(self, path: str, seen: dict) -> None:
        current = self._read_lock(path)
        if current is not None and current.get("token") == seen.get("token"):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)


def _lock_body(token: str) -> bytes:
    return json.dumps({**_host(), "token": token, "touched": time.time()}).encode()


def _lock_is_stale(holder, stale_after_s: float) -> bool:
    """A dead holder on this host, no heartbeat for `stale_after_s`, or a lock that is not one (malformed, or
    touched in the future beyond clock skew: `touched: 1e18` would otherwise hold its key forever)."""
    if not isinstance(holder, dict):
        return True
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and type(pid) is int and pid > 0 and pid != os.getpid():
        from .locks import _alive

        if not _alive(pid):
            return True
    touched = holder.get("touched", 0.0)
    if type(touched) not in (int, float) or touched != touched:  # a string, a bool, NaN
        return True
    age = time.time() - float(touched)
    return age > stale_after_s or age < -CLOCK_SKEW_S


def unit_paths(unit: str, key, where: str):
    """A test of the workspace paths a record of `unit` may name (its folder, a plan's same-stem siblings, the
    provenance of its key); StoreError when the unit's name itself is not a unit."""
    from .safe_paths import checked_relative

    parts = checked_relative(unit, where=where, field="unit", error=StoreError).parts
    kind_ok = (len(parts) == 2 and parts[0] in SOURCE_KINDS) or (len(parts) == 3 and parts[0] == "engines")
    if not kind_ok or any(p.startswith(".") for p in parts) or unit.endswith(".lock"):
        raise StoreError(f"{where}: {unit!r} is not a unit (<kind>/<name>.<key> or engines/<target>/<name>.<key>)")
    unit_key = unit_spec_key(unit)
    provenance = f"provenance/{key}.json" if isinstance(key, str) and key == unit_key and unit_key else None
    folder_prefix = unit + "/"
    is_file_unit = parts[0] == "engines" and parts[-1].rsplit(".", 1)[-1] != unit_key  # `<name>.<key>.plan`
    stem = parts[-1].rsplit(".", 1)[0] if is_file_unit else None
    sibling_dir = "/".join(parts[:-1]) + "/"

    def allowed(relative: str) -> bool:
        names = relative.split("/")
        if any(n.startswith(".") or n.endswith(".lock") for n in names):
            return False  # the cache's state files, locks, temporaries
        if relative == provenance:
            return True
        if relative.startswith(folder_prefix):
            return True
        if stem and relative.startswith(sibling_dir) and "/" not in relative[len(sibling_dir):]:
            name = relative[len(sibling_dir):]
            return name.startswith(stem + ".") and unit_spec_key(name) == unit_key
        return False

    return allowed


def _filesystem(url: str, storage_options: dict):
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError:
        raise MissingDependencyError(f"build.workspace {mask_url(url)} is a URL, which needs fsspec; {INSTALL_HINT}") \
            from None
    protocol = urlsplit(url).scheme.lower()
    try:
        return url_to_fs(url, **storage_options)
    except ImportError:
        backend = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}.get(
            protocol, "its fsspec backend")
        raise MissingDependencyError(f"build.workspace {mask_url(url)} needs {backend} ({protocol}:// through fsspec "
                                     f"{fsspec.__version__}); {INSTALL_HINT}") from None
    except ValueError as exc:
        raise ConfigError(f"build.workspace {mask_url(url)}: {exc}") from None


def unit_spec_key(unit: str) -> str:
    """`engines/<target>/<name>.<key>` or `<name>.<key>.plan`: the spec key in a unit's name."""
    parts = unit.rsplit("/", 1)[-1].split(".")
    return next((p for p in reversed(parts) if re.fullmatch(r"[0-9a-f]{16}", p)), "")
