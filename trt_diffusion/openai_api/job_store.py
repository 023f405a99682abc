"""The job store: uploaded batch files, batches and their request lines, persisted so that a restart of the API
process on the same state folder finishes what it had started (docs/deploy.md).

One SQLite file (stdlib sqlite3, WAL) under the state folder holds the records; file contents and each line's
result are files beside it, written under a temporary name and renamed, then recorded: a crash between the two
leaves a file no record names, which the next run overwrites. Only what a job needs is kept: request bodies (the
seed assigned at submission included), results, statuses and times. The folder has a quota (bytes of every
content and result file) and a retention: a file or a finished batch older than it is deleted.

`JobStore` is the interface the routes and the runner use; SQLite is the one backend (a deployment with several
API fronts would put a shared database behind the same methods: docs/deploy.md)."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .errors import ApiError

DATABASE = "jobs.sqlite3"
SCHEMA_VERSION = 1
DEFAULT_MAX_BYTES = 10 * 1024**3  # --state-max-gb 10
DEFAULT_RETENTION_S = 7 * 24 * 3600.0
TERMINAL = ("completed", "failed", "expired", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, metadata TEXT);
CREATE TABLE IF NOT EXISTS videos (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, model TEXT NOT NULL, prompt TEXT NOT NULL, body TEXT NOT NULL,
    seconds TEXT NOT NULL, size TEXT NOT NULL, status TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL, completed_at INTEGER, expires_at INTEGER, error TEXT, bytes INTEGER NOT NULL DEFAULT 0,
    reference_bytes INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    status TEXT NOT NULL, result_bytes INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, idx));
"""


@dataclass(frozen=True)
class StoredFile:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None

    def card(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at}


@dataclass(frozen=True)
class Line:
    batch_id: str
    index: int
    custom_id: str
    body: dict
    status: str  # pending | ok | error


class JobStore(Protocol):
    """What the routes and the runner need of a store (one backend today: SqliteJobStore)."""

    def add_file(self, purpose: str, filename: str, content: bytes) -> StoredFile: ...
    def file(self, file_id: str) -> StoredFile: ...
    def file_content(self, file_id: str) -> bytes: ...
    def file_content_path(self, file_id: str) -> Path: ...
    def add_batch(self, endpoint: str, input_file_id: str, completion_window: str, window_s: int,
                  metadata: dict | None, lines: list[tuple[str, dict]]) -> dict: ...
    def batch(self, batch_id: str) -> dict: ...
    def batches(self, after: str | None, limit: int) -> tuple[list[dict], bool]: ...
    def set_status(self, batch_id: str, status: str, *, only_from: tuple[str, ...] = ()) -> bool: ...
    def next_batch(self) -> dict | None: ...
    def pending_lines(self, batch_id: str) -> list[Line]: ...
    def record_line(self, line: Line, status: str, record: dict) -> None: ...
    def finalize(self, batch_id: str, status: str, leftover_error: dict | None = None) -> dict: ...
    def sweep(self) -> int: ...


def default_state_dir() -> Path:
    """$XDG_STATE_HOME/trt-diffusion, else ~/.local/state/trt-diffusion (the XDG base directory rule)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "trt-diffusion"


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class SqliteJobStore:
    def __init__(self, folder: str | Path, max_bytes: int = DEFAULT_MAX_BYTES,
                 retention_s: float = DEFAULT_RETENTION_S, clock: Callable[[], float] = time.time):
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.retention_s = retention_s
        self.clock = clock
        self._lock = threading.Lock()
        self._seq = 0
        self._folder_lock = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            # one process per folder: two runners would both take the oldest batch and run its lines twice
            self._folder_lock = open(self.folder / "jobs.lock", "a")  # noqa: SIM115 - held until close()
            try:
                fcntl.flock(self._folder_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._folder_lock.close()
                raise StateError(f"the state folder {self.folder} is in use by another process (an API serving "
                                 "jobs from it); stop it or give another --state-dir") from None
            (self.folder / "files").mkdir(exist_ok=True)
            (self.folder / "results").mkdir(exist_ok=True)
            self._db = sqlite3.connect(self.folder / DATABASE, check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a recorded result survives a power cut, not only a kill
            self._db.executescript(_SCHEMA)
            version = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if version is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif version[0] != str(SCHEMA_VERSION):
                raise StateError(f"the job store {self.folder / DATABASE} has schema {version[0]}, this version "
                                 f"reads {SCHEMA_VERSION}: use another --state-dir")
            problems = [row[0] for row in self._db.execute("PRAGMA quick_check(3)")]
            if problems != ["ok"]:
                self._db.close()
                raise StateError(f"the job store {self.folder / DATABASE} is damaged ({'; '.join(problems)}); "
                                 "move it away to start with an empty store, or give another --state-dir")
            self._seq = self._db.execute("SELECT MAX(COALESCE((SELECT MAX(seq) FROM batches), 0), "
                                         "COALESCE((SELECT MAX(seq) FROM videos), 0))").fetchone()[0]
            self._sweep_orphans()
        except sqlite3.DatabaseError as exc:  # a corrupt or foreign file: say so, never start over silently
            self._unlock()
            raise StateError(f"the job store {self.folder / DATABASE} cannot be read ({exc}); move it away to "
                             "start with an empty store, or give another --state-dir") from None
        except OSError as exc:
            self._unlock()
            raise StateError(f"cannot use the state folder {self.folder} ({exc.strerror or exc})") from None
        except StateError:
            self._unlock()
            raise

    def _unlock(self) -> None:
        if self._folder_lock is not None and not self._folder_lock.closed:
            self._folder_lock.close()  # closing the descriptor releases the flock

    def close(self) -> None:
        self._db.close()
        self._unlock()

    def _sweep_orphans(self) -> None:
        """Delete what a crash left without a record (a file is written before its row; temporaries before their
        rename): nothing names it, the quota would not count it and the retention would never delete it. Only at
        start, under the folder's lock: no other writer is half-way."""
        db = self._db
        named = {row[0] for row in db.execute("SELECT id FROM files")}
        for row in db.execute("SELECT id, reference_bytes FROM videos"):
            named.add(f"{row[0]}.mp4")
            named.add(f"{row[0]}.reference.png")
        for path in (self.folder / "files").iterdir():
            if path.name not in named and path.is_file():
                path.unlink(missing_ok=True)
        live = {row[0] for row in db.execute("SELECT id FROM batches WHERE status NOT IN (?, ?, ?, ?)", TERMINAL)}
        for path in (self.folder / "results").iterdir():
            if path.name not in live:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        for path in (self.folder / "results").glob("*/.*.tmp"):
            path.unlink(missing_ok=True)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _now(self) -> int:
        return int(self.clock())

    # quota
    def used_bytes(self) -> int:
        with self._lock:
            files = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()[0]
            results = self._db.execute("SELECT COALESCE(SUM(result_bytes), 0) FROM lines").fetchone()[0]
            videos = self._db.execute("SELECT COALESCE(SUM(bytes + reference_bytes), 0) FROM videos").fetchone()[0]
            # the request bodies live in the database: they count as well, or a batch could fill the disk past it
            stored = self._db.execute("SELECT COALESCE(SUM(LENGTH(body)), 0) FROM lines").fetchone()[0]
        return files + results + videos + stored

    def _reserve(self, size: int, what: str, moving: int = 0) -> None:
        """413 unless `size` more bytes fit; `moving`: bytes already counted that this write replaces."""
        used = self.used_bytes() - moving
        if used + size > self.max_bytes:
            raise ApiError(413, f"{what} ({size} bytes) does not fit in the job store: {used} of its "
                                f"{self.max_bytes} bytes are used (--state-max-gb); delete jobs or wait for the "
                                "retention to free space", code="state_quota_exceeded")

    def _write(self, path: Path, content: bytes) -> None:
        """Atomically: a temporary beside it, fsync, rename. Disk full is an error naming the folder."""
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            with open(temporary, "wb") as stream:
                stream.write(content)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, path)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            # no path in the message: it reaches clients (the log has the folder)
            raise StateError(f"cannot write {path.name} in the job store's state folder ({exc.strerror or exc}); "
                             "free disk space or lower --state-max-gb below what the disk holds") from None

    # files
    def _file_path(self, file_id: str) -> Path:
        return self.folder / "files" / file_id

    def add_file(self, purpose: str, filename: str, content: bytes, file_id: str | None = None) -> StoredFile:
        self._reserve(len(content), f"the file {filename!r}")
        file_id = file_id or _new_id("file")
        now = self._now()
        stored = StoredFile(file_id, purpose, filename, len(content), now, int(now + self.retention_s))
        self._write(self._file_path(file_id), content)
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)",
                       (stored.id, purpose, filename, stored.bytes, stored.created_at, stored.expires_at))
        return stored

    def file(self, file_id: str) -> StoredFile:
        with self._lock:
            row = self._db.execute("SELECT * FROM files WHERE id=?", (file_id,)).fetchone()
        if row is None:
            raise ApiError(404, f"no file {file_id!r} (unknown, or deleted after its retention)", "file_id",
                           "file_not_found")
        return StoredFile(**dict(row))

    def file_content(self, file_id: str) -> bytes:
        return self.file_content_path(file_id).read_bytes()

    def file_content_path(self, file_id: str) -> Path:
        """Where a stored file's content is (to stream it); StateError when it was removed by hand."""
        self.file(file_id)
        path = self._file_path(file_id)
        if not path.is_file():
            raise StateError(f"the content of {file_id} is missing from the job store's state folder: it was "
                             "removed by hand")
        return path

    # batches
    def add_batch(self, endpoint: str, input_file_id: str, completion_window: str, window_s: int,
                  metadata: dict | None, lines: list[tuple[str, dict]]) -> dict:
        batch_id = _new_id("batch")
        now = self._now()
        stored = [(custom_id, json.dumps(body)) for custom_id, body in lines]
        self._reserve(sum(len(body) for _, body in stored), "the batch's request bodies")
        with self._tx() as db:
            self._seq += 1
            db.execute("INSERT INTO batches (id, seq, endpoint, input_file_id, completion_window, status, "
                       "created_at, expires_at, metadata) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?, ?)",
                       (batch_id, self._seq, endpoint, input_file_id, completion_window, now, now + window_s,
                        json.dumps(metadata) if metadata is not None else None))
            db.executemany("INSERT INTO lines (batch_id, idx, custom_id, body, status) VALUES (?, ?, ?, ?, 'pending')",
                           [(batch_id, index, custom_id, body) for index, (custom_id, body) in enumerate(stored)])
        return self.batch(batch_id)

    def batch(self, batch_id: str) -> dict:
        with self._lock:
            row = self._db.execute("SELECT * FROM batches WHERE id=?", (batch_id,)).fetchone()
            if row is None:
                raise ApiError(404, f"no batch {batch_id!r} (unknown, or deleted after its retention)", "batch_id",
                               "batch_not_found")
            counts = dict(self._db.execute("SELECT status, COUNT(*) FROM lines WHERE batch_id=? GROUP BY status",
                                           (batch_id,)).fetchall())
            total = self._db.execute("SELECT COUNT(*) FROM lines WHERE batch_id=?", (batch_id,)).fetchone()[0]
        return _batch_card(dict(row), total, counts.get("ok", 0), counts.get("error", 0))

    def batches(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """The newest first; `after`: those older than that batch (OpenAI's cursor)."""
        rows = self._page("batches", "batch", "id", after, limit)
        return [self.batch(row[0]) for row in rows[:limit]], len(rows) > limit

    def set_status(self, batch_id: str, status: str, *, only_from: tuple[str, ...] = ()) -> bool:
        """Move a batch to `status` (stamping its time), only from `only_from` when given; whether it moved."""
        stamp = {"in_progress": "in_progress_at", "cancelling": "cancelling_at",
                 "finalizing": "finalizing_at", "failed": "failed_at"}.get(status)
        with self._tx() as db:
            row = db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()
            if row is None or (only_from and row[0] not in only_from):
                return False
            db.execute(f"UPDATE batches SET status=?{f', {stamp}=?' if stamp else ''} WHERE id=?",
                       (status, self._now(), batch_id) if stamp else (status, batch_id))
        return True

    def next_batch(self) -> dict | None:
        """The oldest batch not finished (a cancelling one first: it only needs its files)."""
        with self._lock:
            row = self._db.execute(
                "SELECT id FROM batches WHERE status NOT IN (?, ?, ?, ?) ORDER BY status != 'cancelling', seq "
                "LIMIT 1", TERMINAL).fetchone()
        return None if row is None else self.batch(row[0])

    def pending_lines(self, batch_id: str) -> list[Line]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM lines WHERE batch_id=? AND status='pending' ORDER BY idx",
                                    (batch_id,)).fetchall()
        return [Line(row["batch_id"], row["idx"], row["custom_id"], json.loads(row["body"]), row["status"])
                for row in rows]

    def _result_path(self, batch_id: str, index: int) -> Path:
        return self.folder / "results" / batch_id / f"{index}.json"

    def record_line(self, line: Line, status: str, record: dict) -> None:
        """A line's output record (OpenAI's batch output line), written then marked done: a crash before the mark
        runs the line again (its stored seed gives the same images), never loses it."""
        content = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        self._reserve(len(content), f"the result of line {line.index + 1} ({line.custom_id})")
        path = self._result_path(line.batch_id, line.index)
        path.parent.mkdir(exist_ok=True)
        self._write(path, content)
        with self._tx() as db:
            db.execute("UPDATE lines SET status=?, result_bytes=? WHERE batch_id=? AND idx=?",
                       (status, len(content), line.batch_id, line.index))

    def finalize(self, batch_id: str, status: str, leftover_error: dict | None = None) -> dict:
        """The batch's output and error files from its lines' results, then its final `status`. The files' ids
        follow from the batch's, so a crash during this and a second run write the same files once.
        `leftover_error` (an expiry): each line not run gets this error in the error file. The results are
        copied a line at a time (never the whole batch in memory); their bytes only move from results/ into the
        files, so the quota counts them once. Blocking: the runner calls it in a worker thread."""
        with self._lock:
            rows = self._db.execute("SELECT idx, custom_id, status, result_bytes FROM lines WHERE batch_id=? "
                                    "ORDER BY idx", (batch_id,)).fetchall()
        moving = sum(row["result_bytes"] for row in rows)
        suffix = batch_id.removeprefix("batch-")
        output_id = error_id = None
        for kind, wanted in (("output", ("ok",)), ("error", ("error", "pending"))):
            chosen = [row for row in rows if row["status"] in wanted
                      and (row["status"] != "pending" or leftover_error is not None)]
            if not chosen:
                continue

            def chunks(chosen=chosen):
                for row in chosen:
                    if row["status"] == "pending":
                        yield (json.dumps({"id": f"batch_req_{batch_id}_{row['idx']}", "custom_id": row["custom_id"],
                                           "response": None, "error": leftover_error}) + "\n").encode()
                    else:
                        yield self._result_path(batch_id, row["idx"]).read_bytes()

            file_id = f"file-{suffix}-{kind}"
            size = self._write_chunks(self._file_path(file_id), chunks(), moving, f"the {kind} file of {batch_id}")
            now = self._now()
            with self._tx() as db:
                db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)",
                           (file_id, "batch_output", f"{batch_id}_{kind}.jsonl", size, now,
                            int(now + self.retention_s)))
            output_id, error_id = (file_id, error_id) if kind == "output" else (output_id, file_id)
        stamp = {"completed": "completed_at", "failed": "failed_at", "expired": "expired_at",
                 "cancelled": "cancelled_at"}[status]
        with self._tx() as db:
            db.execute(f"UPDATE batches SET status=?, {stamp}=?, output_file_id=?, error_file_id=? WHERE id=?",
                       (status, self._now(), output_id, error_id, batch_id))
            db.execute("UPDATE lines SET result_bytes=0 WHERE batch_id=?", (batch_id,))  # now in the files
        shutil.rmtree(self.folder / "results" / batch_id, ignore_errors=True)
        return self.batch(batch_id)

    def _write_chunks(self, path: Path, chunks: Iterator[bytes], moving: int, what: str) -> int:
        """`chunks` into `path` atomically (a temporary, fsync, rename) under the quota, `moving` bytes of which
        are already counted (the results being copied); the bytes written."""
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        room = self.max_bytes - (self.used_bytes() - moving)
        size = 0
        try:
            with open(temporary, "wb") as stream:
                for chunk in chunks:
                    size += len(chunk)
                    if size > room:
                        self._reserve(size, what, moving)  # the 413 naming the quota
                    stream.write(chunk)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, path)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            raise StateError(f"cannot write {path.name} in the job store's state folder ({exc.strerror or exc}); "
                             "free disk space or lower --state-max-gb below what the disk holds") from None
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return size

    def sweep(self) -> int:
        """Delete the files past their expiry (but the input of a batch not finished) and the finished batches
        older than the retention (their lines with them); how many records went."""
        now = self._now()
        # a batch not finished keeps its input file past its expiry (its edit lines read their images from it)
        expired = ("FROM files WHERE expires_at <= ? AND id NOT IN (SELECT input_file_id FROM batches WHERE "
                   "status NOT IN (?, ?, ?, ?))")
        with self._tx() as db:
            gone_files = [row[0] for row in db.execute(f"SELECT id {expired}", (now, *TERMINAL))]
            db.execute(f"DELETE {expired}", (now, *TERMINAL))
            gone_batches = [row[0] for row in db.execute(
                "SELECT id FROM batches WHERE status IN (?, ?, ?, ?) AND created_at + ? <= ?",
                (*TERMINAL, self.retention_s, now))]
            db.executemany("DELETE FROM lines WHERE batch_id=?", [(b,) for b in gone_batches])
            db.executemany("DELETE FROM batches WHERE id=?", [(b,) for b in gone_batches])
            gone_videos = [row[0] for row in db.execute("SELECT id FROM videos WHERE expires_at <= ?", (now,))]
            db.execute("DELETE FROM videos WHERE expires_at <= ?", (now,))
        for video_id in gone_videos:
            self._remove_video_files(video_id)
        for file_id in gone_files:
            self._file_path(file_id).unlink(missing_ok=True)
        for batch_id in gone_batches:
            shutil.rmtree(self.folder / "results" / batch_id, ignore_errors=True)
        return len(gone_files) + len(gone_batches) + len(gone_videos)

    # videos: one job per clip
    def video_path(self, video_id: str, what: str = "mp4") -> Path:
        return self.folder / "files" / f"{video_id}.{what}"

    def _remove_video_files(self, video_id: str) -> None:
        for what in ("mp4", "reference.png"):
            self.video_path(video_id, what).unlink(missing_ok=True)

    def add_video(self, model: str, prompt: str, body: dict, seconds: str, size: str,
                  reference: bytes | None = None) -> dict:
        """A queued video job; `reference` (image-to-video's first frame, a PNG) is kept beside it until it is
        deleted."""
        video_id = _new_id("video")
        if reference is not None:
            self._reserve(len(reference), "the input_reference image")
            self._write(self.video_path(video_id, "reference.png"), reference)
        now = self._now()
        with self._tx() as db:
            self._seq += 1
            db.execute("INSERT INTO videos (id, seq, model, prompt, body, seconds, size, status, created_at, "
                       "expires_at, reference_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, 'queued', ?, ?, ?)",
                       (video_id, self._seq, model, prompt, json.dumps(body), seconds, size, now,
                        int(now + self.retention_s), len(reference or b"")))
        return self.video(video_id)

    def _video_row(self, video_id: str) -> dict:
        with self._lock:
            row = self._db.execute("SELECT * FROM videos WHERE id=?", (video_id,)).fetchone()
        if row is None:
            raise ApiError(404, f"no video {video_id!r} (unknown, deleted, or past its retention)", "video_id",
                           "video_not_found")
        return dict(row)

    def video(self, video_id: str) -> dict:
        return _video_card(self._video_row(video_id))

    def video_job(self, video_id: str) -> tuple[dict, bytes | None]:
        """(the stored request body, the reference image or None) of a video job."""
        row = self._video_row(video_id)
        reference = self.video_path(video_id, "reference.png").read_bytes() if row["reference_bytes"] else None
        return json.loads(row["body"]), reference

    def videos(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        rows = self._page("videos", "video", "*", after, limit)
        return [_video_card(dict(row)) for row in rows[:limit]], len(rows) > limit

    def _page(self, table: str, kind: str, columns: str, after: str | None, limit: int) -> list:
        """Up to limit + 1 rows of `table` (a constant of this module), newest first, older than `after` (OpenAI's
        cursor): the extra row says whether there are more."""
        with self._lock:
            below = None
            if after is not None:
                row = self._db.execute(f"SELECT seq FROM {table} WHERE id=?", (after,)).fetchone()
                if row is None:
                    raise ApiError(404, f"no {kind} {after!r} to list after", "after", f"{kind}_not_found")
                below = row[0]
            return self._db.execute(f"SELECT {columns} FROM {table} WHERE seq < COALESCE(?, seq + 1) "
                                    "ORDER BY seq DESC LIMIT ?", (below, limit + 1)).fetchall()

    def next_job(self) -> tuple[str, dict] | None:
        """("batch" | "video", its card): the oldest job not finished, whichever kind."""
        with self._lock:
            batch = self._db.execute("SELECT id, seq FROM batches WHERE status NOT IN (?, ?, ?, ?) ORDER BY "
                                     "status != 'cancelling', seq LIMIT 1", TERMINAL).fetchone()
            video = self._db.execute("SELECT id, seq FROM videos WHERE status IN ('queued', 'in_progress') ORDER BY "
                                     "seq LIMIT 1").fetchone()
        if batch is not None and (video is None or batch["seq"] < video["seq"]):
            return "batch", self.batch(batch["id"])
        return None if video is None else ("video", self.video(video["id"]))

    def set_video(self, video_id: str, status: str, progress: int = 0, error: dict | None = None) -> None:
        with self._tx() as db:
            db.execute("UPDATE videos SET status=?, progress=?, error=?, completed_at=? WHERE id=?",
                       (status, progress, json.dumps(error) if error else None,
                        self._now() if status in ("completed", "failed") else None, video_id))

    def finish_video(self, video_id: str, write: Callable[[Path], None]) -> None:
        """`write(path)` the clip, then the job is completed; over the quota, the clip is removed and ApiError
        413 raised (the caller marks the job failed with it)."""
        path = self.video_path(video_id)
        write(path)
        size = path.stat().st_size
        try:
            self._reserve(size, "the video")
        except ApiError:
            path.unlink(missing_ok=True)
            raise
        with self._tx() as db:
            db.execute("UPDATE videos SET bytes=? WHERE id=?", (size, video_id))
        self.set_video(video_id, "completed", 100)

    def video_content(self, video_id: str) -> bytes:
        return self.video_content_path(video_id).read_bytes()

    def video_content_path(self, video_id: str) -> Path:
        """Where a completed video's .mp4 is (to stream it); 409 before it is completed."""
        card = self.video(video_id)
        if card["status"] != "completed":
            raise ApiError(409, f"video {video_id} is {card['status']}: its content is there once it is completed",
                           "video_id", "video_not_ready")
        path = self.video_path(video_id)
        if not path.is_file():
            raise StateError(f"the content of {video_id} is missing from the job store's state folder: it was "
                             "removed by hand")
        return path

    def delete_video(self, video_id: str) -> None:
        self._video_row(video_id)
        with self._tx() as db:
            db.execute("DELETE FROM videos WHERE id=?", (video_id,))
        self._remove_video_files(video_id)


class StateError(ApiError):
    """The state folder cannot be used (unreadable store, disk full): a server-side error naming the folder."""

    def __init__(self, message: str):
        super().__init__(500, message, None, "state_error")


def _video_card(row: dict) -> dict:
    """A video job as OpenAI's Video object (plus `frames`: what the seconds were served as)."""
    body = json.loads(row["body"])
    return {"id": row["id"], "object": "video", "model": row["model"], "prompt": row["prompt"],
            "status": row["status"], "progress": row["progress"], "seconds": row["seconds"], "size": row["size"],
            "frames": body.get("frames"), "seed": body.get("seed"), "created_at": row["created_at"],
            "completed_at": row["completed_at"], "expires_at": row["expires_at"],
            "error": json.loads(row["error"]) if row["error"] else None, "remixed_from_video_id": None}


def _batch_card(row: dict, total: int, completed: int, failed: int) -> dict:
    """A batch as OpenAI's Batch object."""
    card = {key: row[key] for key in ("id", "endpoint", "input_file_id", "completion_window", "status",
                                      "created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at",
                                      "failed_at", "expired_at", "cancelling_at", "cancelled_at", "output_file_id",
                                      "error_file_id")}
    card.update(object="batch", errors=None, metadata=json.loads(row["metadata"]) if row["metadata"] else None,
                request_counts={"total": total, "completed": completed, "failed": failed})
    return card
