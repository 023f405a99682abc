"""Resident memory of a whole process tree, sampled in the background, per stage (for the bench scripts).

    with RssSampler() as sampler, marks_from_progress(sampler):
        ...   # every trt_diffusion progress line marks the stage later samples belong to
    sampler.report("quantize 3/4"), sampler.peak() / fp32_weight_bytes(model_dir)

`run_step` runs one measured step of a script in a fresh process, so the peak it reports is that step's own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import psutil

GIB = 1 << 30


def fp32_weight_bytes(model_dir: Path, component: str = "unet") -> int:
    """A component's weights as stored (fp32 safetensors, every shard): what memory is measured against."""
    return sum(path.stat().st_size for path in (Path(model_dir) / component).glob("*.safetensors"))


def run_step(script: str, args: list[str], *, live_stderr: bool = False) -> dict:
    """`python script *args` in a fresh process; its last stdout line is its JSON result.

    `live_stderr`: the step's stderr (progress lines) goes straight to ours; otherwise it is kept and its
    tail shown when the step fails."""
    done = subprocess.run([sys.executable, script, *args], stdout=subprocess.PIPE,
                          stderr=None if live_stderr else subprocess.PIPE, text=True)
    if done.returncode != 0:
        tail = f":\n{done.stderr[-4000:]}" if done.stderr else ""
        raise SystemExit(f"{' '.join(args)} failed (exit {done.returncode}){tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class RssSampler:
    """Samples the memory of this process and all its descendants; `mark(stage)` attributes later samples
    to `stage`.

    Two figures per sample, each summed over the process tree: resident set size, and its anonymous part
    (RSS minus file-backed pages). diffusers memory-maps safetensors, so weights count toward RSS only as
    they are touched; the anonymous part is what the export really allocates.
    """

    def __init__(self, interval_s: float = 0.05):
        self.process = psutil.Process()
        self.interval_s = interval_s
        self.stage = "start"
        self.peaks: dict[str, tuple[int, int]] = {}
        self.at_start: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()
        return False

    def sample(self) -> tuple[int, int]:
        rss = anonymous = 0
        for process in [self.process, *self.process.children(recursive=True)]:
            try:
                info = process.memory_info()
            except psutil.NoSuchProcess:  # a child that ended between listing and reading
                continue
            rss, anonymous = rss + info.rss, anonymous + info.rss - info.shared
        return rss, anonymous

    def mark(self, stage: str) -> None:
        self.stage = stage
        self.at_start.setdefault(stage, self.sample())

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, anonymous = self.sample()
            peak = self.peaks.get(self.stage, (0, 0))
            self.peaks[self.stage] = (max(peak[0], rss), max(peak[1], anonymous))
            self._stop.wait(self.interval_s)

    def report(self, stage: str) -> dict:
        start, peak = self.at_start.get(stage, (0, 0)), self.peaks.get(stage, (0, 0))
        return {"rss_at_start_gb": round(start[0] / GIB, 2), "rss_peak_gb": round(peak[0] / GIB, 2),
                "anonymous_at_start_gb": round(start[1] / GIB, 2), "anonymous_peak_gb": round(peak[1] / GIB, 2),
                "anonymous_growth_gb": round((peak[1] - start[1]) / GIB, 2)}

    def peak(self) -> int:
        """The highest whole-tree RSS seen, in bytes."""
        return max((rss for rss, _ in self.peaks.values()), default=0)

    def stages(self) -> list[str]:
        return list(self.at_start)


class _ProgressMarks(logging.Handler):
    """Marks `sampler` with each progress task's stage (a stage with numbered steps, like the quantize
    stage's four, is marked per step)."""

    def __init__(self, sampler: RssSampler, numbered: tuple[str, ...]):
        super().__init__(logging.INFO)
        self.sampler, self.numbered = sampler, numbered

    def emit(self, record: logging.LogRecord) -> None:
        task = getattr(record, "progress_task", None)
        if task is None:
            return
        label = task.stage
        if task.stage in self.numbered and task.position is not None:
            label = f"{task.stage} {task.position}/{task.total}"
        self.sampler.mark(label)


@contextlib.contextmanager
def marks_from_progress(sampler: RssSampler, numbered: tuple[str, ...] = ("quantize",)):
    from trt_diffusion.progress import LOGGER_NAME

    logger = logging.getLogger(LOGGER_NAME)
    handler = _ProgressMarks(sampler, numbered)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
