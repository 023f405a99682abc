"""Review findings on the job store and runner (issue #46): a batch whose results fill half the quota still
finalizes; a batch that keeps failing is failed, not retried forever ahead of every later job; one process per
state folder; the request bodies count in the quota; a store quick_check finds damaged is refused; a cancel of a
batch not running finalizes it at once; a video whose run breaks fails instead of running again forever;
uploads left by a crash before their record are swept at start."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading

import pytest

from trt_diffusion.openai_api.errors import ApiError
from trt_diffusion.openai_api.job_runner import JobRunner
from trt_diffusion.openai_api.job_store import SqliteJobStore, StateError

ENDPOINT = "/v1/images/generations"
HANG_GUARD_S = 60  # a guard against a hang, not a timing


def lines(count: int) -> list[tuple[str, dict]]:
    return [(f"req-{i}", {"prompt": f"p{i}", "seed": i}) for i in range(count)]


def test_a_batch_whose_results_fill_most_of_the_quota_still_finalizes(tmp_path):
    store = SqliteJobStore(tmp_path, max_bytes=1000)
    batch = store.add_batch(ENDPOINT, "file-x", "24h", 86400, None, lines(2))

    async def run_line(endpoint, body):
        return {"data": "x" * 250}  # a ~360-byte result line each: 720 of 1000 bytes

    done = asyncio.run(JobRunner(store, run_line).run_batch(batch))
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 2
    assert len(store.file_content(done["output_file_id"]).splitlines()) == 2
    assert store.used_bytes() < 1000  # the results moved into the output file, counted once


class BrokenStore(SqliteJobStore):
    """A batch whose lines cannot be read (the state failing for it alone)."""

    broken: str = ""

    def pending_lines(self, batch_id):
        if batch_id == self.broken:
            raise OSError("the disk said no")
        return super().pending_lines(batch_id)


def test_a_batch_that_keeps_failing_is_failed_and_the_next_job_runs(tmp_path):
    store = BrokenStore(tmp_path)
    stuck = store.add_batch(ENDPOINT, "file-x", "24h", 86400, None, lines(1))
    store.broken = stuck["id"]
    later = store.add_batch(ENDPOINT, "file-y", "24h", 86400, None, lines(1))
    ran = asyncio.Event()

    async def run_line(endpoint, body):
        ran.set()
        return {}

    async def main():
        runner = JobRunner(store, run_line, retry_s=0.001, poll_s=0.001).start()
        await asyncio.wait_for(ran.wait(), 60)  # a guard, not a timing: the later batch runs at all
        await runner.stop()

    asyncio.run(main())
    assert store.batch(stuck["id"])["status"] == "failed"
    assert store.batch(later["id"])["status"] != "validating"  # it was taken up


def test_one_process_per_state_folder(tmp_path):
    first = SqliteJobStore(tmp_path / "state")
    with pytest.raises(StateError, match=r"state folder .*state is in use by another process"):
        SqliteJobStore(tmp_path / "state")
    first.close()
    SqliteJobStore(tmp_path / "state").close()  # free again once the first is closed


def test_batch_bodies_count_in_the_quota(tmp_path):
    store = SqliteJobStore(tmp_path, max_bytes=1000)
    with pytest.raises(ApiError) as refused:
        store.add_batch(ENDPOINT, "file-x", "24h", 86400, None, [("a", {"prompt": "x" * 2000})])
    assert refused.value.status == 413
    store.add_batch(ENDPOINT, "file-x", "24h", 86400, None, [("a", {"prompt": "x" * 400})])
    assert store.used_bytes() >= 400


def test_a_store_quick_check_finds_damaged_is_refused(tmp_path):
    SqliteJobStore(tmp_path).close()
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:  # a NULL where the schema says NOT NULL
        db.execute("CREATE TABLE t (a)")
        db.execute("INSERT INTO t VALUES (NULL)")
        db.execute("PRAGMA writable_schema=ON")
        db.execute("UPDATE sqlite_master SET sql='CREATE TABLE t (a NOT NULL)' WHERE name='t'")
    with pytest.raises(StateError, match=r"jobs.sqlite3 is damaged .*NULL value in t.a"):
        SqliteJobStore(tmp_path)


def test_a_cancel_after_the_last_line_ran_is_cancelled_not_completed(tmp_path):
    store = SqliteJobStore(tmp_path)
    batch = store.add_batch(ENDPOINT, "file-x", "24h", 86400, None, lines(1))

    async def run_line(endpoint, body):
        store.set_status(batch["id"], "cancelling", only_from=("in_progress",))  # cancel while the call ends
        return {}

    done = asyncio.run(JobRunner(store, run_line).run_batch(batch))
    assert done["status"] == "cancelled" and done["cancelled_at"] is not None


PNG = b"\x89PNG\r\n\x1a\n" + b"0" * 32


def video_body() -> dict:
    return {"model": "wan-tiny", "prompt": "a", "seed": 1, "frames": 5}


def test_a_video_whose_reference_is_gone_fails_instead_of_running_again(tmp_path):
    store = SqliteJobStore(tmp_path)
    video = store.add_video("wan-tiny", "a", video_body(), "1", "64x64", reference=PNG)
    store.video_path(video["id"], "reference.png").unlink()  # removed by hand

    async def run_video(body, reference, progress):
        raise AssertionError("not run without its reference")

    asyncio.run(JobRunner(store, None, run_video=run_video).run_video_job(video))
    card = store.video(video["id"])
    assert card["status"] == "failed" and card["error"]["code"] == "internal_error"


def test_a_video_whose_encoding_breaks_fails_with_a_generic_message(tmp_path):
    store = SqliteJobStore(tmp_path)
    video = store.add_video("wan-tiny", "a", video_body(), "1", "64x64")

    async def run_video(body, reference, progress):
        def write(path):
            raise RuntimeError("encoder exploded at /secret/path")
        return write

    asyncio.run(JobRunner(store, None, run_video=run_video).run_video_job(video))
    card = store.video(video["id"])
    assert card["status"] == "failed" and "secret" not in json.dumps(card["error"])
    assert "internal error" in card["error"]["message"]


def test_a_clip_is_written_off_the_event_loop(tmp_path):
    store = SqliteJobStore(tmp_path)
    video = store.add_video("wan-tiny", "a", video_body(), "1", "64x64")
    served = threading.Event()

    async def run_video(body, reference, progress):
        loop = asyncio.get_running_loop()

        def write(path):  # the encoder: the event loop must answer while it runs
            loop.call_soon_threadsafe(served.set)  # runs only if the loop is free
            assert served.wait(HANG_GUARD_S), "the event loop was blocked while the clip was written"
            path.write_bytes(b"mp4")
        return write

    asyncio.run(JobRunner(store, None, run_video=run_video).run_video_job(video))
    assert store.video(video["id"])["status"] == "completed"


def test_files_left_without_a_record_by_a_crash_are_swept_at_start(tmp_path):
    store = SqliteJobStore(tmp_path)
    kept = store.add_file("batch", "in.jsonl", b"{}\n")
    video = store.add_video("wan-tiny", "a", video_body(), "1", "64x64", reference=PNG)
    running = store.add_batch(ENDPOINT, kept.id, "24h", 86400, None, lines(2))
    store.record_line(store.pending_lines(running["id"])[0], "ok", {"x": 1})
    store.close()
    files, results = tmp_path / "files", tmp_path / "results"
    orphans = [files / "file-0123456789abcdef01234567",  # written, then killed before its record
               files / ".file-x.1234abcd.tmp", files / "video-0123456789abcdef01234567.mp4",
               results / "batch-0123456789abcdef01234567" / "0.json"]
    for path in orphans:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"left by a crash")
    store = SqliteJobStore(tmp_path)
    assert [path for path in orphans if path.exists()] == []
    assert store.file_content(kept.id) == b"{}\n"  # what the records name stays
    assert store.video_job(video["id"])[1] == PNG
    assert len(store.pending_lines(running["id"])) == 1  # a running batch's results stay
    assert (results / running["id"] / "0.json").exists()


def test_a_result_waiting_for_room_gets_what_the_retention_frees(tmp_path):
    now = [1_000_000.0]
    store = SqliteJobStore(tmp_path, max_bytes=1000, retention_s=100, clock=lambda: now[0])
    store.add_file("batch", "old.jsonl", b"x" * 800)
    batch = store.add_batch(ENDPOINT, "file-x", "24h", 86400, None, lines(1))
    now[0] += 101  # the old file is past the retention; nothing has swept yet

    async def run_line(endpoint, body):
        return {"data": "y" * 300}

    async def main():  # the guard only turns a hang into a failure
        return await asyncio.wait_for(JobRunner(store, run_line, retry_s=0.001).run_batch(batch), HANG_GUARD_S)

    assert asyncio.run(main())["status"] == "completed"
