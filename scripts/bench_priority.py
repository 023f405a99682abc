"""Interactive before batch: the latency of a person's `images.generate` with the API idle and while a batch of job
lines runs behind it (issue #46's bar: P99 under a full batch backlog within 1.5x of idle).

Reuses bench_triton.py's tiny sd15 repository (engines for onnxruntime, `--instances` pipeline instances), starts
the bundled tritonserver and the API (its job runner in the same process, a fresh state folder) on 127.0.0.1, and
sends interactive requests one after another with the official `openai` client, in rounds that alternate:

  idle     no batch anywhere; `--requests` interactive requests;
  backlog  a batch of `--lines` /v1/images/generations lines (files.create(purpose="batch") + batches.create, as the
           jobs tests submit them) is started, the runner's first line awaited, then `--requests` interactive
           requests; the batch is cancelled after them. The batch must still be in progress when the phase ends
           and no line may have failed (otherwise the backlog ran dry: the script says so and exits 1 — raise
           --lines).

The phase that comes first flips every round, so a drift of the machine's load touches both alike. Reported:
P50 / P99 (numpy's linear percentile) of each, P99(backlog) / P99(idle) against the bar, the request count, the job
lines the batch got through meanwhile, the CPU. How the API orders them: jobs reach Triton at the batch priority
level and a job line starts only while it leaves one of the model's instances to people (openai_api/job_slots.py);
a running line waits between engine calls while a person's request runs on another instance (the entry's
per-instance activity files), so what is left is at most the engine call it was in.

    python scripts/bench_priority.py [--workdir build/bench-priority] [--rounds 8] [--requests 40] [--lines 400]
                                     [--steps 10] [--job-steps 10] [--instances 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_triton's repository preparation and helpers
from bench_triton import SIZE, prepare_repository  # noqa: E402

BAR = 1.5  # the bar: P99 under backlog <= 1.5x P99 idle
TERMINAL = ("completed", "failed", "expired", "cancelled")


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--workdir", type=Path, default=Path("build/bench-priority"),
                        help="tiny model, engines, Triton repository and the API's state (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=8, help="idle/backlog round pairs (default %(default)s)")
    parser.add_argument("--requests", type=int, default=40,
                        help="interactive requests per phase and round (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="interactive requests dropped at the start")
    parser.add_argument("--lines", type=int, default=400,
                        help="lines of each backlog batch; must outlast a phase (default %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps of an interactive request")
    parser.add_argument("--job-steps", type=int, default=None, help="denoising steps of a job line (default --steps)")
    parser.add_argument("--instances", type=int, default=2,
                        help="pipeline instances of the entry (jobs may hold all but one; default %(default)s)")
    parser.add_argument("--settle-s", type=float, default=2.0,
                        help="pause after a batch is cancelled, for the line Triton still runs (default %(default)s)")
    parser.add_argument("--json", type=Path, help="write the figures and every sample here")
    args = parser.parse_args(argv)
    if args.job_steps is None:
        args.job_steps = args.steps
    if min(args.rounds, args.requests, args.lines, args.instances) < 1:
        parser.error("--rounds, --requests, --lines and --instances must be at least 1")
    return args


class Interactive:
    """One person: the official `openai` client, one request at a time."""

    def __init__(self, client, model: str, steps: int):
        self.client, self.model, self.steps = client, model, steps
        self.count = 0

    def __call__(self) -> float:
        self.count += 1
        start = time.perf_counter()
        result = self.client.images.generate(model=self.model, prompt=f"a lighthouse {self.count}",
                                             size=f"{SIZE}x{SIZE}",
                                             extra_body={"seed": self.count, "num_inference_steps": self.steps})
        seconds = time.perf_counter() - start
        if not result.data or not result.data[0].b64_json:
            raise RuntimeError("an interactive request came back without an image")
        return seconds


def batch_file(client, model: str, lines: int, steps: int) -> str:
    body = "".join(json.dumps({"custom_id": f"poster-{i}", "method": "POST", "url": "/v1/images/generations",
                               "body": {"model": model, "prompt": f"poster {i}", "size": f"{SIZE}x{SIZE}",
                                        "seed": 10_000 + i, "num_inference_steps": steps}}) + "\n"
                   for i in range(lines))
    return client.files.create(file=("backlog.jsonl", body.encode()), purpose="batch").id


def wait_for(client, batch_id: str, done, what: str, timeout_s: float = 300.0):
    end = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        if time.monotonic() > end:
            raise RuntimeError(f"batch {batch_id} did not {what} in {timeout_s:.0f} s (status {batch.status})")
        time.sleep(0.05)


def backlog_phase(client, file_id: str, person: Interactive, requests: int, settle_s: float) -> dict:
    """A batch started and busy, `requests` interactive requests under it, the batch cancelled."""
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/images/generations", completion_window="24h")
    # the runner is cycling lines once the first one is done (a line starts whenever the job slot is free)
    before = wait_for(client, batch.id, lambda b: b.status in TERMINAL or b.request_counts.completed >= 1,
                      "start running lines")
    start = time.perf_counter()
    samples = [person() for _ in range(requests)]
    seconds = time.perf_counter() - start
    after = client.batches.retrieve(batch.id)
    held = after.status == "in_progress"  # still lines left: the backlog never ran dry during the phase
    if after.status not in TERMINAL:
        client.batches.cancel(batch.id)
        wait_for(client, batch.id, lambda b: b.status in TERMINAL, "end after its cancel")
    time.sleep(settle_s)  # a cancelled call leaves Triton's running execution to finish
    lines = after.request_counts.completed + after.request_counts.failed \
        - before.request_counts.completed - before.request_counts.failed
    return {"samples_s": samples, "held": held, "job_lines": lines, "seconds": seconds,
            "failed_lines": after.request_counts.failed}


def percentiles(samples: list[float]) -> dict:
    values = np.array(samples)
    return {"n": len(samples), "p50_ms": float(np.percentile(values, 50) * 1000),
            "p99_ms": float(np.percentile(values, 99) * 1000), "mean_ms": float(values.mean() * 1000),
            "max_ms": float(values.max() * 1000)}


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)

    import openai

    from trt_diffusion.openai_api.server import ApiServer
    from trt_diffusion.openai_api.settings import ApiSettings
    from trt_diffusion.triton.stage import start
    from trt_diffusion.workspace.provenance import cpu_name

    start_time = time.perf_counter()
    # queue room for every caller (one person, one job line): a 429 here would be a benchmark fault, not a figure
    _, report, _, _ = prepare_repository(args.workdir, instances=args.instances, max_queue_size=16, ensemble=False)
    print(f"engines and repository ready in {time.perf_counter() - start_time:.1f} s", file=sys.stderr)
    state = args.workdir / "api-state"
    shutil.rmtree(state, ignore_errors=True)  # no batch of an earlier run may run here
    server, _ = start(report.repo, work_dir=args.workdir / "server", first_request=True)
    api = None
    rounds = []
    try:
        api = ApiServer(ApiSettings(server.grpc_url, port=0, state_dir=state)).start()
        client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=300)
        person = Interactive(client, report.entry, args.steps)
        for _ in range(args.warmup):
            person()
        file_id = batch_file(client, report.entry, args.lines, args.job_steps)
        for number in range(args.rounds):
            phases = ("idle", "backlog") if number % 2 == 0 else ("backlog", "idle")
            row = {}
            for phase in phases:
                if phase == "idle":
                    begin = time.perf_counter()
                    row["idle"] = {"samples_s": [person() for _ in range(args.requests)],
                                   "seconds": time.perf_counter() - begin}
                else:
                    row["backlog"] = backlog_phase(client, file_id, person, args.requests, args.settle_s)
            idle, backlog = percentiles(row["idle"]["samples_s"]), percentiles(row["backlog"]["samples_s"])
            print(f"round {number + 1}/{args.rounds} ({' then '.join(phases)}): idle P50 {idle['p50_ms']:.1f} ms, "
                  f"backlog P50 {backlog['p50_ms']:.1f} ms, {row['backlog']['job_lines']} job lines meanwhile"
                  + ("" if row["backlog"]["held"] else " - BACKLOG RAN DRY"), file=sys.stderr, flush=True)
            rounds.append(row)
        client.close()
    finally:
        if api is not None:
            api.stop()
        server.stop()

    idle = percentiles([s for row in rounds for s in row["idle"]["samples_s"]])
    backlog = percentiles([s for row in rounds for s in row["backlog"]["samples_s"]])
    job_lines = sum(row["backlog"]["job_lines"] for row in rounds)
    backlog_seconds = sum(row["backlog"]["seconds"] for row in rounds)
    failed_lines = sum(row["backlog"]["failed_lines"] for row in rounds)
    held = all(row["backlog"]["held"] for row in rounds) and not failed_lines
    ratio = backlog["p99_ms"] / idle["p99_ms"]
    cpu = cpu_name()
    summary = {
        "cpu": cpu, "size": SIZE, "model": report.entry, "instances": args.instances, "steps": args.steps,
        "job_steps": args.job_steps, "rounds": args.rounds, "requests_per_phase": args.requests,
        "lines_per_batch": args.lines, "idle": idle, "backlog": backlog, "p99_ratio": ratio, "bar": BAR,
        "within_bar": ratio <= BAR, "backlog_held": held, "job_lines_during_backlog": job_lines,
        "job_lines_per_s": job_lines / backlog_seconds, "failed_lines": failed_lines,
        "rounds_detail": rounds}
    print(f"\ninteractive images.generate, {report.entry} {SIZE}x{SIZE}, {args.steps} steps, one at a time; "
          f"{args.instances} pipeline instances; {args.rounds} rounds x {args.requests} requests per phase, "
          f"alternating; CPU {cpu}")
    for name, row in (("idle", idle), ("backlog", backlog)):
        print(f"  {name:8s} n {row['n']:4d}  P50 {row['p50_ms']:8.1f} ms  P99 {row['p99_ms']:8.1f} ms  "
              f"mean {row['mean_ms']:8.1f} ms  max {row['max_ms']:8.1f} ms")
    print(f"  job lines ({args.job_steps} steps) completed under the interactive load: {job_lines} "
          f"({summary['job_lines_per_s']:.2f}/s), {failed_lines} failed; backlog held through every phase: {held}")
    print(f"  P99 backlog / idle = {ratio:.2f}x - the bar {BAR}x {'holds' if ratio <= BAR else 'is MISSED'}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
