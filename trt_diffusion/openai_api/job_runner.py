"""The job runner: a background task of the API process (no other service) that runs the stored batches, oldest
first, one line at a time, each through the same entry the online route uses (`run_line`).

A line's answer is recorded before the next starts, so a killed process loses at most the line it was running,
which the next start runs again with its stored seed. Triton busy (429) or unavailable (503) is not the line's
failure: the line waits and is tried again. A cancelled batch's running line is cancelled (its gRPC call with it,
which frees Triton's queue); a batch past its completion window stops, its lines not run going to the error file
as `batch_expired`. A running video's `progress` follows its denoising steps as the video entry's stream reports
them (video_routes.video_runner), written to the store at most once per step and once every PROGRESS_EVERY_S.
A job's call to Triton has the jobs' deadline (ApiSettings.job_timeout_s, --job-timeout: a day), not the online
--timeout: its request yields to people between engine calls, and that wait is no reason to fail it
(job_slots.BatchPriorityClient sets it)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from .errors import ApiError
from .job_store import TERMINAL, JobStore, Line, StateError

log = logging.getLogger("trt_diffusion.openai_api.jobs")
RETRY_STATUSES = (429, 503)  # Triton's queue full or Triton away: try the line again later
MAX_JOB_FAILURES = 3  # a job that breaks the runner this many times in a row is failed, not retried ahead of all
PROGRESS_EVERY_S = 2.0  # a running video's progress is written to the store at most this often
EXPIRED = {"code": "batch_expired",
           "message": "This request could not be executed before the completion window expired."}


def _record(line: Line, status: int, body: dict) -> dict:
    """One line of OpenAI's batch output (or error) file."""
    request_id = f"batch_req_{line.batch_id}_{line.index}"
    return {"id": request_id, "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


class VideoProgress:
    """A running video's `progress` (0-100) as its steps report it: written when it grows, at most once every
    `every_s` (each write is an fsync'd SQLite transaction); never lowered (a retried run starts its steps again)."""

    def __init__(self, store: JobStore, video_id: str, every_s: float, clock: Callable[[], float] = time.monotonic):
        self.store, self.video_id, self.every_s, self.clock = store, video_id, every_s, clock
        self.value = 0
        self.written_at = clock()

    def __call__(self, percent: int) -> None:
        percent = max(0, min(int(percent), 99))  # 100 is written with the clip
        if percent <= self.value or self.clock() - self.written_at < self.every_s:
            return
        self.value, self.written_at = percent, self.clock()
        try:
            self.store.set_video(self.video_id, "in_progress", progress=percent)
        except Exception:  # noqa: BLE001 - a progress value is not worth failing the clip for
            log.warning("video %s: its progress could not be written", self.video_id, exc_info=True)


class JobRunner:
    def __init__(self, store: JobStore, run_line: Callable[[str, dict], Awaitable[dict]], *,
                 run_video: Callable[[dict, bytes | None, Callable[[int], None]], Awaitable[Callable]] | None = None,
                 slot_free: Callable[[str | None], Awaitable[bool]] | None = None,
                 poll_s: float = 5.0, retry_s: float = 2.0, progress_every_s: float | None = None):
        self.store = store
        self.run_line = run_line  # (endpoint, body) -> the online route's answer; ApiError as the route's refusal
        # (body, reference PNG or None, progress(percent)) -> write(path): the clip from the video entry (reporting
        # its steps' progress as it goes), and how to write its .mp4
        self.run_video = run_video
        self.progress_every_s = progress_every_s  # None: PROGRESS_EVERY_S
        # (model) -> whether a job may take one of its instances now (job_slots.JobSlots.free); None: always
        self.slot_free = slot_free
        self.waiting_for_slot = False
        self.poll_s = poll_s  # how often an idle runner looks for expiries and the retention
        self.retry_s = retry_s
        self._wake = asyncio.Event()  # bound to a loop at first use (Python 3.10+)
        self._running: tuple[str, asyncio.Task] | None = None
        self._task: asyncio.Task | None = None
        self.current: str | None = None  # the batch or video the runner works on now (cancel finalizes the others)
        self._failures: tuple[str, int] = ("", 0)  # (job id, failures in a row)

    def start(self) -> JobRunner:
        self._task = asyncio.ensure_future(self._loop())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """Stop the line of `batch_id` (a batch or a video job) running now, if one is (its batch is marked
        cancelling already, or the video deleted)."""
        if self._running is not None and self._running[0] == batch_id:
            self._running[1].cancel()
        self.wake()

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            pass
        self._wake.clear()

    async def _loop(self) -> None:
        while True:
            job = None
            try:
                self.store.sweep()
                job = self.store.next_job()
                if job is None:
                    await self._sleep(self.poll_s)
                elif job[0] == "batch":
                    await self.run_batch(job[1])
                else:
                    await self.run_video_job(job[1])
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or the state folder failing: logged, and the loop keeps serving
                log.exception("the job runner failed; trying again in %.0f s", self.retry_s)
                if job is not None:
                    await self._failed_again(*job)
                await self._sleep(self.retry_s)
            finally:
                self.current = None

    async def _failed_again(self, kind: str, card: dict) -> None:
        """Count a job's failures in a row; at MAX_JOB_FAILURES it is failed, so the jobs behind it run (next_job
        would hand it out first forever, even after a restart)."""
        job_id, count = self._failures
        count = count + 1 if job_id == card["id"] else 1
        self._failures = (card["id"], count)
        if count < MAX_JOB_FAILURES:
            return
        log.error("%s %s failed %d times in a row: marked failed", kind, card["id"], count)
        error = {"code": "job_failed", "message": "the job could not be run (internal error); the server log has "
                                                  "the details", "param": None}
        try:
            if kind == "batch":
                try:  # with the files of the lines that ran, when they can be written
                    await asyncio.to_thread(self.store.finalize, card["id"], "failed")
                except Exception:  # noqa: BLE001 - the status alone, then
                    self.store.set_status(card["id"], "failed")
            else:
                self.store.set_video(card["id"], "failed", error=error)
        except Exception:  # noqa: BLE001 - the store itself is failing: the next round tries again
            log.exception("%s %s could not be marked failed", kind, card["id"])

    async def run_batch(self, batch: dict) -> dict:
        """Run `batch`'s pending lines, then write its files; its final card."""
        batch_id = batch["id"]
        self.current = batch_id
        if batch["status"] == "validating":
            self.store.set_status(batch_id, "in_progress", only_from=("validating",))
        for line in self.store.pending_lines(batch_id):
            while True:
                state = self.store.batch(batch_id)
                if state["status"] in TERMINAL:  # finalized meanwhile (a cancel while it waited)
                    return state
                if state["status"] == "cancelling":
                    return await asyncio.to_thread(self.store.finalize, batch_id, "cancelled")
                if self.store.clock() >= state["expires_at"]:
                    return await asyncio.to_thread(self.store.finalize, batch_id, "expired", EXPIRED)
                if not await self._slot(line.body.get("model")):
                    continue  # the batch may have been cancelled or expired meanwhile
                outcome = await self._run(line)
                if outcome is None:  # retried: cancelled, Triton busy or away, or no room for the result
                    continue
                status, body = outcome
                try:
                    self.store.record_line(line, "ok" if status == 200 else "error", _record(line, status, body))
                except ApiError as err:  # the quota or the disk: the line stays pending, nothing is lost
                    log.error("batch %s line %d: its result cannot be stored (%s); retrying in %.0f s", batch_id,
                              line.index + 1, err.message, self.retry_s)
                    await self._sleep(self.retry_s)
                    self.store.sweep()  # the retention may free the room it waits for
                    continue
                break
        if not self.store.set_status(batch_id, "finalizing", only_from=("in_progress",)):
            state = self.store.batch(batch_id)
            if state["status"] in TERMINAL:
                return state
            if state["status"] == "cancelling":  # cancelled after its last line's call had finished
                return await asyncio.to_thread(self.store.finalize, batch_id, "cancelled")
        return await asyncio.to_thread(self.store.finalize, batch_id, "completed")

    async def _slot(self, model: str | None) -> bool:
        """Whether the job may start its call now; False after a wait (woken by an online request ending, a
        cancel, or the poll): the caller looks at its job again before asking once more."""
        if self.slot_free is None or await self.slot_free(model):
            self.waiting_for_slot = False
            return True
        self.waiting_for_slot = True
        await self._sleep(self.poll_s)
        return False

    async def run_video_job(self, video: dict) -> None:
        """One clip: run, then its .mp4 in the store; a refusal fails the job with the entry's words."""
        video_id = video["id"]
        self.current = video_id
        self.store.set_video(video_id, "in_progress")
        every_s = PROGRESS_EVERY_S if self.progress_every_s is None else self.progress_every_s
        progress = VideoProgress(self.store, video_id, every_s)  # one for all its tries: never lowered
        while True:
            try:
                body, reference = self.store.video_job(video_id)
            except ApiError:  # deleted meanwhile
                return
            except Exception:  # noqa: BLE001 - its reference image unreadable: running again cannot help
                log.exception("video %s: its stored request cannot be read", video_id)
                return self._video_broke(video_id)
            if not await self._slot(body["model"]):
                continue
            outcome = await self._run(Line(video_id, 0, video_id, body, "pending"),
                                      lambda: self.run_video(body, reference, progress))
            if outcome is None:
                try:
                    self.store.video(video_id)
                except ApiError:
                    return  # deleted (its running call was cancelled)
                continue
            status, result = outcome
            if status == 200:
                try:
                    self.store.video(video_id)  # deleted while it ran: nothing to write
                    # the H.264 encoding takes seconds: off the event loop, which serves the online requests
                    await asyncio.to_thread(self.store.finish_video, video_id, result)
                    return
                except ApiError as err:
                    status, result = err.status, err.body()
                except Exception:  # noqa: BLE001 - the encoder or the disk: failed, not run again forever
                    log.exception("video %s: its clip could not be written", video_id)
                    return self._video_broke(video_id)
            error = result["error"]
            self.store.set_video(video_id, "failed", error={"code": error.get("code") or "generation_failed",
                                                           "message": error["message"], "param": error.get("param")})
            return

    def _video_broke(self, video_id: str) -> None:
        """Fail a video on a server-side error: a generic 500 message, the details in the log only."""
        self.store.set_video(video_id, "failed", error={
            "code": "internal_error", "message": "the video could not be made (internal error); the server log has "
                                                 "the details", "param": None})

    async def _run(self, line: Line, work: Callable[[], Awaitable] | None = None) -> tuple[int, object] | None:
        """(status, body) of one line as the online route would answer it; None: run it again later."""
        from tritonclient.utils import InferenceServerException

        task = asyncio.ensure_future(work() if work is not None else self.run_line_body(line))
        self._running = (line.batch_id, task)
        try:
            await asyncio.wait({task})
        finally:
            self._running = None
            if not task.done():  # the runner itself is stopping
                task.cancel()
        if task.cancelled():
            return None  # its batch was cancelled: the loop sees it
        error = task.exception()
        if error is None:
            return 200, task.result()
        if isinstance(error, StateError):
            raise error
        if isinstance(error, ApiError) and error.status not in RETRY_STATUSES:
            return error.status, error.body()
        if isinstance(error, ApiError) or (isinstance(error, InferenceServerException)
                                           and "UNAVAILABLE" in str(error.status() or "")):
            log.warning("batch %s line %d: %s; trying again in %.0f s", line.batch_id, line.index + 1,
                        getattr(error, "message", error), self.retry_s)
            await self._sleep(self.retry_s)
            return None
        log.error("batch %s line %d failed", line.batch_id, line.index + 1, exc_info=error)
        return 500, ApiError(500, f"internal error ({type(error).__name__}); the server log has the details").body()

    async def run_line_body(self, line: Line) -> dict:
        return await self.run_line(self.endpoint_of(line), line.body)

    def endpoint_of(self, line: Line) -> str:
        return self.store.batch(line.batch_id)["endpoint"]
