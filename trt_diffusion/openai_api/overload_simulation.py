"""What an overload policy (engines.yaml `serving: overload:`) does at a given offered load, in virtual time: the
REAL OverloadGate (overload.py) with an injected clock and a StepCosts seeded from a measured per-step time, fed
arrivals every 1/rate s for `duration_s`, `instances` servers taking the admitted requests first come first served,
each admitted request released when its (possibly degraded) cost has run. Deterministic: no thread, no wall clock.

The cost model is the truth here: a request runs exactly what the gate estimates for it (steps x per-step seconds,
scaled by pixels for a smaller bucket), so a degraded request saves what the cost model says it saves. preflight's
overload check runs it over the service time it measured (docs/preflight.md): a simulation, not a second load run."""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from .overload import OverloadGate, OverloadPolicy, Refused, StepCosts


@dataclass
class SimulationResult:
    offered: int = 0
    as_asked: int = 0  # admitted and run as asked
    degraded: Counter = field(default_factory=Counter)  # what was lowered ("steps 20->8") -> requests
    refused: int = 0
    waits_s: list[float] = field(default_factory=list)  # of the admitted: arrival to the start of its run
    latencies_s: list[float] = field(default_factory=list)  # of the admitted: arrival to the end of its run
    retry_after_s: list[int] = field(default_factory=list)  # each refusal's Retry-After
    max_estimated_wait_s: float = 0.0  # the largest estimated wait a request arrived to

    @property
    def accepted(self) -> int:
        return self.as_asked + sum(self.degraded.values())


def simulate(policy: OverloadPolicy, per_step_s: float, *, size: str, steps: int, rate: float, duration_s: float,
             instances: int = 1, images: int = 1, served_sizes: tuple[str, ...] = (), resizable: bool = True,
             model: str = "model") -> SimulationResult:
    """Arrivals at i / rate s for i < max(1, int(duration_s x rate)) (as the check's open loop sends them), each
    asking `steps` at `size` for `images` images; `per_step_s` seeds the cost model for (model, size)."""
    if rate <= 0 or per_step_s < 0 or instances < 1:
        raise ValueError(f"rate must be positive, per_step_s not negative, instances at least 1 (got {rate}, "
                         f"{per_step_s}, {instances})")
    now = [0.0]
    gate = OverloadGate({model: policy}, StepCosts(known={(model, size): per_step_s}),
                        instances=lambda _: instances, clock=lambda: now[0])
    result = SimulationResult()
    free_at = [0.0] * instances  # when each server is next free (a heap)
    running: list[tuple[float, int, object]] = []  # (finish, arrival index, admission): released in order
    count = max(1, int(duration_s * rate))
    for index in range(count):
        arrival = index / rate
        while running and running[0][0] <= arrival:
            finish, _, admission = heapq.heappop(running)
            now[0] = finish
            gate.release(admission, finished=True)
        now[0] = arrival
        result.offered += 1
        result.max_estimated_wait_s = max(result.max_estimated_wait_s, gate.estimated_wait_s(model))
        try:
            admission = gate.admit(model, size, steps, images, served_sizes, resizable=resizable)
        except Refused as refused:
            result.refused += 1
            result.retry_after_s.append(int(refused.headers["Retry-After"]))
            continue
        if admission.degraded is None:
            result.as_asked += 1
        else:
            result.degraded[admission.degraded] += 1
        start = max(arrival, heapq.heappop(free_at))  # first come, first served: the earliest free server
        finish = start + admission.cost_s
        heapq.heappush(free_at, finish)
        heapq.heappush(running, (finish, index, admission))
        result.waits_s.append(start - arrival)
        result.latencies_s.append(finish - arrival)
    return result
