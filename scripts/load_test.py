"""Capacity, then overload at 1.5x capacity: is excess load refused fast, and do accepted requests stay fast?

1. Capacity: closed-loop clients at concurrency 1..N, each for a few seconds; capacity = the best
   requests/s.
2. Overload: open-loop arrivals at 1.5x capacity for a bounded time (and a bounded request count), each
   request with a client deadline. Reports accepted / rejected counts, P50 / P99 latency of the accepted,
   and how fast rejections came back. Nothing may hang: every request ends within its deadline.

Traffic goes to 127.0.0.1 only: a server this script starts (tiny sd15, see bench_triton.py), or `--url`
pointing at a loopback server already running.

    python scripts/load_test.py [--workdir build/load-test] [--instances 2] [--max-queue-size 4] \\
        [--steps 30] [--max-concurrency 4] [--overload-seconds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_triton's repository preparation

SIZE = 64
LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


@dataclass
class Outcome:
    kind: str  # accepted | rejected | cancelled | error
    seconds: float
    message: str = ""


@dataclass
class Phase:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    late_arrivals: int = 0  # open loop: arrivals the client could not send on schedule

    def of(self, kind: str) -> list[float]:
        return sorted(o.seconds for o in self.outcomes if o.kind == kind)

    def summary(self) -> dict:
        accepted, rejected = self.of("accepted"), self.of("rejected")
        return {
            "name": self.name, "requests": len(self.outcomes), "accepted": len(accepted), "rejected": len(rejected),
            "cancelled": len(self.of("cancelled")), "errors": len(self.of("error")), "wall_s": self.wall_s,
            "throughput_rps": len(accepted) / self.wall_s if self.wall_s else 0.0,
            "p50_s": percentile(accepted, 50), "p99_s": percentile(accepted, 99),
            "rejection_p99_s": percentile(rejected, 99), "rejection_max_s": max(rejected) if rejected else None,
            "error_samples": sorted({o.message for o in self.outcomes if o.kind == "error"})[:3],
        }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    rank = max(0, math.ceil(q / 100 * len(values)) - 1)  # nearest-rank
    return sorted(values)[rank]


class Client:
    """One gRPC connection per thread; every request carries a deadline, so nothing can hang."""

    def __init__(self, url: str, model: str, steps: int, deadline_s: float):
        self.url, self.model, self.steps, self.deadline_s = url, model, steps, deadline_s
        self.local = threading.local()

    def send(self, seed: int) -> Outcome:
        from trt_diffusion.errors import ServeError
        from trt_diffusion.triton.client import (
            ImageRequest,
            RequestCancelled,
            RequestRejected,
            client_module,
            connect,
            infer,
        )

        if not hasattr(self.local, "client"):
            self.local.client = connect(self.url, "grpc")
        module = client_module("grpc")
        start = time.perf_counter()
        try:
            infer(self.local.client, module, self.model, ImageRequest("a lighthouse", SIZE, SIZE, steps=self.steps,
                                                                      seed=seed),
                  protocol="grpc", timeout_s=self.deadline_s, url=self.url)
            return Outcome("accepted", time.perf_counter() - start)
        except RequestRejected as err:
            return Outcome("rejected", time.perf_counter() - start, str(err)[-80:])
        except RequestCancelled as err:
            return Outcome("cancelled", time.perf_counter() - start, str(err)[-80:])
        except ServeError as err:
            return Outcome("error", time.perf_counter() - start, str(err)[-120:])


def closed_loop(client: Client, concurrency: int, seconds: float, max_requests: int) -> Phase:
    phase = Phase(f"closed loop x{concurrency}")
    stop_at = time.perf_counter() + seconds
    lock = threading.Lock()
    counter = iter(range(max_requests))

    def worker() -> None:
        while time.perf_counter() < stop_at:
            with lock:
                seed = next(counter, None)
            if seed is None:
                return
            outcome = client.send(seed)
            with lock:
                phase.outcomes.append(outcome)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + client.deadline_s + 5)
    phase.wall_s = time.perf_counter() - start
    return phase


def open_loop(client: Client, rate_rps: float, seconds: float, max_requests: int, max_in_flight: int) -> Phase:
    """Arrivals on a fixed schedule, whatever the server does (that is what overload means)."""
    phase = Phase(f"open loop {rate_rps:.1f} req/s")
    count = min(max_requests, int(rate_rps * seconds))
    interval = 1.0 / rate_rps
    late = 0
    with ThreadPoolExecutor(max_in_flight) as pool:
        start = time.perf_counter()
        futures = []
        for i in range(count):
            due = start + i * interval
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            elif delay < -interval:
                late += 1  # the client could not keep the schedule (pool full): counted, not hidden
            futures.append(pool.submit(client.send, 10_000 + i))
        done, not_done = wait(futures, timeout=client.deadline_s + 10)
        phase.wall_s = time.perf_counter() - start
    phase.outcomes = [f.result() for f in done]
    phase.outcomes += [Outcome("error", client.deadline_s, "no answer within the deadline")] * len(not_done)
    phase.late_arrivals = late
    return phase


def check_loopback(url: str) -> None:
    host = url.rsplit(":", 1)[0]
    if host not in LOOPBACK:
        raise SystemExit(f"--url must be a loopback address ({', '.join(LOOPBACK)}), got {url!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("build/load-test"))
    parser.add_argument("--url", help="gRPC HOST:PORT of a running loopback server (default: start one)")
    parser.add_argument("--model", help="model to load (default: the repository's entry)")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--max-queue-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--capacity-seconds", type=float, default=5.0)
    parser.add_argument("--overload-factor", type=float, default=1.5)
    parser.add_argument("--overload-seconds", type=float, default=20.0)
    parser.add_argument("--max-requests", type=int, default=2000)
    parser.add_argument("--deadline", type=float, default=30.0, help="client deadline per request, seconds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    server = None
    if args.url:
        check_loopback(args.url)
        url, model = args.url, args.model
        if model is None:
            from trt_diffusion.triton.client import served_sizes

            model, _ = served_sizes(url, protocol="grpc")
    else:
        from bench_triton import prepare_repository

        from trt_diffusion.triton.stage import start

        _, report, _, _ = prepare_repository(args.workdir, instances=args.instances,
                                             max_queue_size=args.max_queue_size, ensemble=False)
        server, warmup = start(report.repo, work_dir=args.workdir / "server", first_request=True)
        url, model = server.grpc_url, args.model or report.entry
        print(f"server ready in {warmup.seconds_to_ready:.1f} s at {url}; {args.instances} instance(s), "
              f"queue {args.max_queue_size}", file=sys.stderr)
    try:
        client = Client(url, model, args.steps, args.deadline)
        capacity_phases = []
        for concurrency in range(1, args.max_concurrency + 1):
            phase = closed_loop(client, concurrency, args.capacity_seconds, args.max_requests)
            capacity_phases.append(phase)
            summary = phase.summary()
            print(f"concurrency {concurrency}: {summary['throughput_rps']:.1f} req/s, P50 "
                  f"{(summary['p50_s'] or 0) * 1000:.0f} ms, rejected {summary['rejected']}", file=sys.stderr)
        capacity = max(p.summary()["throughput_rps"] for p in capacity_phases)
        if capacity <= 0:
            raise SystemExit("no request succeeded while measuring capacity")
        rate = args.overload_factor * capacity
        in_flight = args.instances + args.max_queue_size + 32  # rejections return at once, so this suffices
        overload = open_loop(client, rate, args.overload_seconds, args.max_requests, in_flight)
        live = _server_live(url)
    finally:
        if server is not None:
            server.stop()

    result = {"steps": args.steps, "size": SIZE, "instances": args.instances, "max_queue_size": args.max_queue_size,
              "capacity_rps": capacity, "capacity": [p.summary() for p in capacity_phases],
              "overload": {**overload.summary(), "rate_rps": rate, "late_arrivals": overload.late_arrivals},
              "server_live_after": live}
    o = result["overload"]
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f} ms"  # noqa: E731
    print(f"\ncapacity: {capacity:.1f} req/s ({args.steps} steps, {SIZE}x{SIZE}, {args.instances} instance(s), "
          f"queue {args.max_queue_size})")
    print(f"overload at {args.overload_factor}x = {rate:.1f} req/s for {o['wall_s']:.1f} s: {o['requests']} sent, "
          f"{o['accepted']} accepted, {o['rejected']} rejected, {o['cancelled']} past deadline, {o['errors']} errors"
          f" ({o['late_arrivals']} arrivals late)")
    print(f"accepted latency P50 {ms(o['p50_s'])}, P99 {ms(o['p99_s'])}; rejections P99 {ms(o['rejection_p99_s'])},"
          f" max {ms(o['rejection_max_s'])}; accepted throughput {o['throughput_rps']:.1f} req/s; "
          f"server live afterwards: {live}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=lambda v: asdict(v)))
    healthy = live and o["errors"] == 0 and o["cancelled"] == 0
    return 0 if healthy else 1


def _server_live(url: str) -> bool:
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(url)
    try:
        return bool(client.is_server_live())
    except Exception:  # noqa: BLE001
        return False
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
