"""Names read from a manifest, a store record or a server reply: a relative name inside its own folder.

Files written by another host (a shared workspace, an object store, a Triton server) are input, not
instructions: a path they carry is accepted only as a name relative to the folder it belongs to — never
absolute, never climbing out with `..`, never empty or `.`, and never passing through a symbolic link.
Where a single file name is meant, no separator at all. One helper here, used everywhere such a name is
joined to a folder; the error names the file, the field and the value.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from ..errors import ConfigError, TrtDiffusionError

_MAX_NAME = 255
_MAX_PATH = 4096


def _fail(error: type[TrtDiffusionError], where: str, field: str, value: object, why: str) -> TrtDiffusionError:
    return error(f"{where}: field {field!r} = {value!r} {why}")


def checked_name(value: object, *, where: str, field: str, error: type[TrtDiffusionError] = ConfigError) -> str:
    """`value` when it is one plain file name (no separator, not `.`/`..`, not empty), else `error`."""
    if not isinstance(value, str):
        raise _fail(error, where, field, value, "is not a file name (a string)")
    if value in ("", ".", ".."):
        raise _fail(error, where, field, value, "is not a file name")
    if "/" in value or "\\" in value or "\x00" in value:
        raise _fail(error, where, field, value, "must be a plain file name, without a folder")
    if len(value) > _MAX_NAME:
        raise _fail(error, where, field, value[:40] + "...", "is too long for a file name")
    return value


def checked_relative(value: object, *, where: str, field: str,
                     error: type[TrtDiffusionError] = ConfigError) -> PurePosixPath:
    """`value` as a relative POSIX path whose every part is a plain name (no absolute path, no `..`, no empty
    or `.` part, no backslash), else `error`."""
    if not isinstance(value, str):
        raise _fail(error, where, field, value, "is not a path (a string)")
    if len(value) > _MAX_PATH:
        raise _fail(error, where, field, value[:40] + "...", "is too long for a path")
    if value.startswith("/") or "\\" in value or "\x00" in value or (len(value) > 1 and value[1] == ":"):
        raise _fail(error, where, field, value, "must be a path relative to its folder")
    parts = value.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise _fail(error, where, field, value, "must be a path inside its folder (no empty, '.' or '..' part)")
    return PurePosixPath(value)


def inside_folder(folder: str | os.PathLike, value: object, *, where: str, field: str,
                  error: type[TrtDiffusionError] = ConfigError, name_only: bool = False) -> Path:
    """`folder / value` once `value` is checked (`checked_name` when `name_only`, else `checked_relative`)
    and no part of it below `folder` is a symbolic link (a missing part is fine: it will be created)."""
    relative = (PurePosixPath(checked_name(value, where=where, field=field, error=error)) if name_only
                else checked_relative(value, where=where, field=field, error=error))
    base = Path(folder)
    current = base
    for part in relative.parts:
        current = current / part
        if is_link(current):
            raise _fail(error, where, field, value, f"passes through a symbolic link ({current}); links are refused")
    return current


def is_link(path: str | os.PathLike) -> bool:
    """True for a symbolic link (broken ones included); False for anything else or nothing."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def links_under(folder: str | os.PathLike) -> list[Path]:
    """Every symbolic link under `folder` (not followed), `folder` itself included."""
    base = Path(folder)
    found = [base] if is_link(base) else []
    if found or not base.is_dir():
        return found
    for root, dirs, files in os.walk(base, followlinks=False):
        for name in dirs + files:
            path = Path(root) / name
            if is_link(path):
                found.append(path)
    return sorted(found)


def refuse_links(folder: str | os.PathLike, *, where: str, error: type[TrtDiffusionError] = ConfigError) -> None:
    """`error` naming the first symbolic link under `folder` (an engine folder holds only real files)."""
    links = links_under(folder)
    if links:
        raise error(f"{where}: {links[0]} is a symbolic link; engine folders must hold only regular files "
                    f"(links are refused: they could bring any file of this host along)")
