"""Interactive requests in flight per instance, where the other instances of the same pipeline on the same server
read them (issue 46): a running batch request (the API's jobs) pauses between engine calls while a person's request
runs on another instance, so the person's request does not share the CPU (GPU) with it.

Every instance of a pipeline's entry, stream and denoise stage is a stub process of its own. Each writes one small
file named after its pid, holding "<pid> <count>" (its interactive requests running now), replaced atomically
(temp + rename) when the count changes, in a folder per server and pipeline: <temp>/trt-diffusion-activity-<uid>/
<server pid>/<pipeline>/ (the server is the stubs' parent process, so two servers on one host, even over one
repository, do not see each other). A reader sums the other instances' files; a file whose process is gone (or a
zombie) counts 0 and is removed, so a crashed instance never stalls jobs. Folders of servers that are gone are
removed when an instance starts. Nothing here ever fails a request: an unreadable folder reads as nobody busy.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

ROOT_PREFIX = "trt-diffusion-activity-"


def root_folder() -> Path:
    """This user's folder of every server's activity (made 0700; refused if it is another user's or a link)."""
    root = Path(tempfile.gettempdir()) / f"{ROOT_PREFIX}{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{root} is not a private folder of this user: the pipeline's instances cannot "
                              "share their activity (a batch request will not pause for people)")
    return root


def process_alive(pid: int) -> bool:
    """Whether `pid` is a running process of this user (a zombie is not: its instance has ended)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or the pid is another user's process now
        return False
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux) or it just ended: kill(0) answered
    return state not in (b"Z", b"X")


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".") or "_"


class Activity:
    """One instance's published count, and what the other instances of its pipeline published.

    `folder`: the pipeline's folder (default: `for_server`'s); `pid`: this instance's (default: os.getpid())."""

    def __init__(self, folder: Path, pid: int | None = None):
        self.folder = Path(folder)
        self.pid = os.getpid() if pid is None else pid
        self.path = self.folder / str(self.pid)
        self._published: int | None = None
        self.folder.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_server(cls, pipeline: str, server_pid: int | None = None, root: Path | None = None) -> Activity:
        """The instance's activity among its pipeline's on this server (a python stub's parent: tritonserver);
        the folders of servers that are gone are removed first."""
        root = root_folder() if root is None else Path(root)
        server_pid = os.getppid() if server_pid is None else server_pid
        prune_servers(root, keep=server_pid)
        return cls(root / str(server_pid) / _safe_name(pipeline))

    def publish(self, count: int) -> None:
        """This instance's interactive requests running now (written only when it changes)."""
        if count == self._published:
            return
        temp = self.folder / f".{self.pid}.tmp"
        try:
            temp.write_text(f"{self.pid} {int(count)}\n")
            os.replace(temp, self.path)
        except OSError:
            return  # the others then read the last count (or none): never a failed request
        self._published = count

    def others_busy(self) -> int:
        """Interactive requests running on the pipeline's other instances (live processes only)."""
        total = 0
        try:
            names = os.listdir(self.folder)
        except OSError:
            return 0
        for name in names:
            if not name.isdigit() or int(name) == self.pid:
                continue
            path = self.folder / name
            try:
                pid_text, count_text = path.read_text().split()
                pid, count = int(pid_text), int(count_text)
            except (OSError, ValueError):
                continue  # removed meanwhile, or not ours: nobody
            if count <= 0:
                continue
            if pid != int(name) or not process_alive(pid):
                try:  # a crashed instance's count: never waited for
                    path.unlink()
                except OSError:
                    pass
                continue
            total += count
        return total

    def close(self) -> None:
        """The instance is ending: its file goes."""
        for path in (self.path, self.folder / f".{self.pid}.tmp"):
            try:
                path.unlink()
            except OSError:
                pass
        self._published = None


def prune_servers(root: Path, keep: int | None = None) -> None:
    """Remove the folders of servers whose process is gone."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if name.isdigit() and int(name) != keep and not process_alive(int(name)):
            shutil.rmtree(root / name, ignore_errors=True)
