"""The job store and its runner without HTTP: a runner stopped in the middle of a batch and a new one on the same
folder finish it with no line lost or run twice; completion windows and the retention on an injected clock; Triton
busy or away retries a line instead of failing it; the quota; a corrupt store is a clear error at start."""

from __future__ import annotations

import asyncio
import json

import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.openai_api.errors import ApiError
from trt_diffusion.openai_api.job_runner import JobRunner
from trt_diffusion.openai_api.job_store import SqliteJobStore

ENDPOINT = "/v1/images/generations"


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def lines(count: int) -> list[tuple[str, dict]]:
    return [(f"req-{i}", {"prompt": f"p{i}", "seed": i}) for i in range(count)]


def output(store: SqliteJobStore, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in store.file_content(file_id).decode().splitlines()]


def run(coro):
    return asyncio.run(coro)


def test_a_new_runner_on_the_same_folder_finishes_the_batch_with_no_line_lost_or_run_twice(tmp_path):
    store = SqliteJobStore(tmp_path / "state")
    batch = store.add_batch(ENDPOINT, "file-x", "24h", 86400, None, lines(5))
    ran = []

    async def first_process():
        stop = asyncio.Event()

        async def run_line(endpoint, body):
            if len(ran) == 2:  # the third line: the process dies while it runs
                stop.set()
                await asyncio.sleep(3600)
            ran.append(body["seed"])
            return {"seed": body["seed"]}

        runner = JobRunner(store, run_line).start()
        await stop.wait()
        await runner.stop()

    run(first_process())
    store.close()
    assert ran == [0, 1]
    reopened = SqliteJobStore(tmp_path / "state")  # a new process on the same folder
    assert reopened.batch(batch["id"])["request_counts"] == {"total": 5, "completed": 2, "failed": 0}

    async def run_line(endpoint, body):
        ran.append(body["seed"])
        return {"seed": body["seed"]}

    done = run(JobRunner(reopened, run_line).run_batch(reopened.batch(batch["id"])))
    assert ran == [0, 1, 2, 3, 4]  # each line once; the interrupted one ran again from its start
    assert done["status"] == "completed" and done["error_file_id"] is None
    records = output(reopened, done["output_file_id"])
    assert [r["custom_id"] for r in records] == [f"req-{i}" for i in range(5)]
    assert [r["response"]["body"]["seed"] for r in records] == list(range(5))
    assert not (tmp_path / "state" / "results" / batch["id"]).exists()  # the per-line results are in the file now


def test_refusals_go_to_the_error_file_and_busy_triton_is_retried(tmp_path):
    store = SqliteJobStore(tmp_path)
    batch = store.add_batch(ENDPOINT, "file-x", "24h", 86400, None, lines(3))
    answers = {0: [ApiError(503, "Triton is unavailable"), ApiError(429, "busy")], 1: [ApiError(400, "size bad",
                                                                                                "size")]}
    calls = []

    async def run_line(endpoint, body):
        calls.append(body["seed"])
        pending = answers.get(body["seed"])
        if pending:
            raise pending.pop(0)
        return {"ok": body["seed"]}

    done = run(JobRunner(store, run_line, retry_s=0.001).run_batch(batch))
    assert calls == [0, 0, 0, 1, 2]  # line 0 tried until Triton answered; line 1's refusal is its answer
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    (error,) = output(store, done["error_file_id"])
    assert error["custom_id"] == "req-1" and error["response"]["status_code"] == 400
    assert error["response"]["body"] == {"error": {"message": "size bad", "type": "invalid_request_error",
                                                   "param": "size", "code": None}}


def test_a_batch_past_its_window_expires_and_its_lines_not_run_are_errors(tmp_path):
    clock = Clock()
    store = SqliteJobStore(tmp_path, clock=clock)
    batch = store.add_batch(ENDPOINT, "file-x", "1h", 3600, None, lines(3))

    async def run_line(endpoint, body):
        clock.now += 3000  # each line takes 50 minutes of the hour
        return {}

    done = run(JobRunner(store, run_line).run_batch(batch))
    assert done["status"] == "expired" and done["request_counts"]["completed"] == 2
    (error,) = output(store, done["error_file_id"])
    assert error["custom_id"] == "req-2" and error["error"]["code"] == "batch_expired"


def test_the_retention_deletes_old_files_and_finished_batches(tmp_path):
    clock = Clock()
    store = SqliteJobStore(tmp_path, retention_s=100, clock=clock)
    kept = store.add_batch(ENDPOINT, "file-x", "24h", 86400, None, lines(1))  # not finished: kept
    upload = store.add_file("batch", "in.jsonl", b"{}\n")
    done = store.add_batch(ENDPOINT, upload.id, "24h", 86400, None, lines(1))
    store.record_line(store.pending_lines(done["id"])[0], "ok", {"x": 1})
    finished = store.finalize(done["id"], "completed")
    clock.now += 99
    assert store.sweep() == 0
    clock.now += 2
    assert store.sweep() == 3  # the upload, the output file, the batch
    for file_id in (upload.id, finished["output_file_id"]):
        with pytest.raises(ApiError, match="no file"):
            store.file(file_id)
        assert not (tmp_path / "files" / file_id).exists()
    assert store.batch(kept["id"])["status"] == "validating"


def test_the_quota_refuses_what_does_not_fit(tmp_path):
    store = SqliteJobStore(tmp_path, max_bytes=1000)
    store.add_file("batch", "a.jsonl", b"x" * 600)
    with pytest.raises(ApiError) as refused:
        store.add_file("batch", "b.jsonl", b"x" * 600)
    assert refused.value.status == 413 and "600 of its 1000 bytes are used (--state-max-gb)" in refused.value.message
    assert len(list((tmp_path / "files").iterdir())) == 1  # the refused file left nothing behind


def test_a_corrupt_store_is_a_clear_error_at_start(tmp_path):
    from trt_diffusion.openai_api.app import create_app
    from trt_diffusion.openai_api.settings import ApiSettings

    (tmp_path / "jobs.sqlite3").write_bytes(b"this is not a database" * 100)
    with pytest.raises(ServeError, match=r"the job store .*jobs.sqlite3 cannot be read .* move it away"):
        create_app(ApiSettings("127.0.0.1:9", state_dir=tmp_path))
    assert (tmp_path / "jobs.sqlite3").read_bytes().startswith(b"this is not")  # left as it was
