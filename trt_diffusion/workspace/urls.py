"""`build.workspace` as written in engines.yaml: a folder, a `file://` URL (a shared directory used as the
workspace itself: NFS and the like), or a URL to an object store (`s3://bucket/prefix`, `gs://…`, any fsspec
backend: remote_store.py).

This module only reads and normalises such a value: whether it is a URL, whether it is remote, how it is
shown (`mask_url`: no user, password, query or fragment in messages and logs), whether engines.yaml's
validation accepts it, and which local folder the stages work in — the workspace itself, or the URL's
*cache* (`build.cache`, else `$TRT_DIFFUSION_CACHE/<hash of the URL>`, else
`~/.cache/trt-diffusion/<hash of the URL>`). It opens no connection.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")


def is_url(text: str) -> bool:
    return bool(_URL.match(str(text)))


def is_remote(text: str) -> bool:
    """A URL whose workspace lives behind fsspec (anything but file://)."""
    return is_url(text) and urlsplit(str(text)).scheme.lower() != "file"


def mask_url(url: str) -> str:
    """The URL without user, password, query or fragment: what messages and logs show."""
    if not is_url(url):
        return str(url)
    parts = urlsplit(str(url))
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    if parts.username or parts.password:
        host = f"***@{host}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def default_cache_root() -> Path:
    configured = os.environ.get("TRT_DIFFUSION_CACHE")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "trt-diffusion"


def local_workspace(workspace: str, cache: str | None, root: Path) -> Path:
    """The local folder the stages work in: the workspace itself (a path or file:// URL), or the URL's cache."""
    if not is_url(workspace):
        return (Path(root) / workspace).resolve()
    parts = urlsplit(workspace)
    if parts.scheme.lower() == "file":
        return Path(parts.path).resolve()
    if cache:
        return (Path(root) / Path(cache).expanduser()).resolve()
    digest = hashlib.sha256(mask_url(workspace).rstrip("/").encode()).hexdigest()[:16]
    return (default_cache_root() / digest).resolve()


def check_workspace_url(workspace: str) -> str | None:
    """Why this build.workspace URL cannot be a workspace (None when it can, or is a path): for engines.yaml's
    validation. A known protocol whose backend is not installed is fine here; using it says what to install."""
    if not is_remote(workspace):
        return None
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return None  # said when the workspace is used, with the extra to install
    protocol = urlsplit(workspace).scheme.lower()
    if protocol not in known_implementations and protocol not in registry:
        return f"{protocol}:// is not a storage protocol fsspec knows (s3://, gs://, az://, file://, …)"
    if not urlsplit(workspace).netloc:
        return f"{mask_url(workspace)} names no bucket or host"
    return None
