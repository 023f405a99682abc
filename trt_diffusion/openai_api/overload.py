"""The overload policy of an online request (engines.yaml `serving: overload:`, docs/deploy.md): an estimated wait
from the work already admitted to the model (a cost model: steps x per-step seconds of its bucket x images, over
the model's instances); past `degrade_after_s` the request runs with the policy's fewer steps or smaller served
size (said in the reply's `x-trt-diffusion-degraded` header, its PNGs' parameters and a counter); past
`refuse_after_s` it is refused, 429 with Retry-After: the seconds until the estimated wait is back under the
threshold. Off for a model without a policy; batch and video jobs never pass through it (nobody waits on them).

The cost model is injected: `StepCosts` learns per-step seconds per (model, bucket) from the requests that
finish; a test gives fixed figures, so thresholds are checked without a clock."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .errors import ApiError

DEGRADED_HEADER = "x-trt-diffusion-degraded"


@dataclass(frozen=True)
class OverloadPolicy:
    degrade_after_s: float | None = None
    refuse_after_s: float | None = None
    degrade_steps: int | None = None
    degrade_size: str | None = None  # "WxH"

    @classmethod
    def from_settings(cls, overload) -> OverloadPolicy:
        """From engines.yaml's `serving: overload:` (engines_file.schema.OverloadSettings)."""
        degrade = overload.degrade
        return cls(overload.degrade_after_s, overload.refuse_after_s, degrade and degrade.steps,
                   degrade and degrade.size)


def policies_from_config(config) -> tuple[tuple[str, OverloadPolicy], ...]:
    """The policies engines.yaml (`openai-api --config`) sets: each model's `serving: overload:`, keyed by the name
    its Triton entry serves it under (what a request's `model` names). A degraded size must be one the model serves
    (one of its buckets): any other would never apply, so it is refused here rather than ignored."""
    from ..errors import ConfigError
    from ..triton.naming import entry_name

    policies, problems = [], []
    for name, model in config.models.items():
        overload = model.serving.overload
        if overload is None:
            continue
        served = [str(bucket.opt) for bucket in model.buckets]
        if overload.degrade is not None and overload.degrade.size is not None and overload.degrade.size not in served:
            problems.append(f"{config.path}: models.{name}.serving.overload.degrade.size: {overload.degrade.size} is "
                            f"not a size {name} serves (its buckets: {', '.join(served)})")
        policies.append((entry_name(name), OverloadPolicy.from_settings(overload)))
    if problems:
        raise ConfigError("; ".join(problems), problems)
    return tuple(policies)


def describe(policy: OverloadPolicy) -> str:
    """A policy in words, for the server's start line."""
    parts = []
    if policy.degrade_after_s is not None:
        lowered = f"{policy.degrade_steps} steps" if policy.degrade_steps is not None else policy.degrade_size
        parts.append(f"degraded to {lowered} past {policy.degrade_after_s:g} s of estimated wait")
    if policy.refuse_after_s is not None:
        parts.append(f"refused past {policy.refuse_after_s:g} s")
    return ", ".join(parts)


class CostModel(Protocol):
    def seconds(self, model: str, size: str, steps: int, images: int) -> float: ...
    def observe(self, model: str, size: str, steps: int, images: int, seconds: float) -> None: ...


@dataclass
class StepCosts:
    """Per-step seconds per (model, size), an exponential average of the requests that finished (`observe`);
    `known` seeds it (warm-up figures, or a test's). A bucket never measured costs what the model's measured
    buckets cost per pixel (the dearest of them), scaled to its size; a model never measured costs `unknown_s` a
    step (0: no estimate until its first request that ran alone finishes, docs/deploy.md)."""

    known: dict[tuple[str, str], float] = field(default_factory=dict)
    unknown_s: float = 0.0
    weight: float = 0.2  # of each new measurement

    def seconds(self, model: str, size: str, steps: int, images: int) -> float:
        per_step = self.known.get((model, size))
        if per_step is None:
            per_pixel = [seconds / _area(bucket) for (name, bucket), seconds in list(self.known.items())
                         if name == model]
            per_step = max(per_pixel) * _area(size) if per_pixel else self.unknown_s
        return per_step * steps * images

    def observe(self, model: str, size: str, steps: int, images: int, seconds: float) -> None:
        per_step = seconds / max(steps * images, 1)
        old = self.known.get((model, size))
        self.known[(model, size)] = per_step if old is None else old + self.weight * (per_step - old)


class Refused(ApiError):
    """429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(429, message, None, "overloaded")
        self.headers = {"Retry-After": str(retry_after_s)}


@dataclass(frozen=True)
class Admission:
    model: str
    size: str
    steps: int
    images: int
    cost_s: float
    degraded: str | None  # what was lowered, for the header; None: as asked
    started: float
    alone: bool  # nothing was admitted ahead of it: its time is its own run, a measurement of the cost model


class OverloadGate:
    def __init__(self, policies: dict[str, OverloadPolicy], costs: CostModel | None = None,
                 instances: Callable[[str], int] = lambda model: 1, clock: Callable[[], float] = time.monotonic):
        self.policies = policies
        self.costs = costs if costs is not None else StepCosts()
        self.instances = instances
        self.clock = clock
        self._admitted: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self.counts: Counter = Counter()  # (model, "degraded" | "refused") -> requests

    def estimated_wait_s(self, model: str) -> float:
        """Seconds of admitted, unfinished work ahead of a new request, spread over the model's instances."""
        with self._lock:
            return sum(self._admitted.get(model, ())) / max(self.instances(model), 1)

    def admit(self, model: str, size: str, steps: int, images: int, served_sizes: tuple[str, ...] = (),
              resizable: bool = True) -> Admission:
        """The request as it will run; Refused past the refusal threshold. `release` it when it is done."""
        policy = self.policies.get(model)
        wait = self.estimated_wait_s(model)
        degraded = None
        if policy is not None and policy.refuse_after_s is not None and wait >= policy.refuse_after_s:
            self.counts[(model, "refused")] += 1
            retry = max(1, math.ceil(wait - policy.refuse_after_s))
            raise Refused(f"{model} is overloaded: the estimated wait is {wait:.0f} s, past its {policy.refuse_after_s:g}"
                          f" s limit (serving: overload: refuse_after_s); retry in {retry} s", retry)
        if policy is not None and policy.degrade_after_s is not None and wait >= policy.degrade_after_s:
            if policy.degrade_steps is not None and policy.degrade_steps < steps:
                degraded = f"steps {steps}->{policy.degrade_steps}"
                steps = policy.degrade_steps
            elif policy.degrade_size is not None and resizable and policy.degrade_size in served_sizes \
                    and _area(policy.degrade_size) < _area(size):
                degraded = f"size {size}->{policy.degrade_size}"
                size = policy.degrade_size
            if degraded is not None:
                self.counts[(model, "degraded")] += 1
        cost = self.costs.seconds(model, size, steps, images)
        with self._lock:
            # alone: nothing admitted ahead, whatever its estimated cost (a request of unknown cost estimates 0)
            alone = not self._admitted.get(model)
            self._admitted.setdefault(model, []).append(cost)
        return Admission(model, size, steps, images, cost, degraded, self.clock(), alone=alone)

    def release(self, admission: Admission, finished: bool) -> None:
        """The request left Triton; `finished`: it ran whole, so its time teaches the cost model."""
        with self._lock:
            self._admitted[admission.model].remove(admission.cost_s)
        if finished and admission.alone:  # a queued request's time includes its wait: not a measurement
            self.costs.observe(admission.model, admission.size, admission.steps, admission.images,
                               self.clock() - admission.started)

    def state(self) -> dict:
        return {f"{model}:{what}": count for (model, what), count in sorted(self.counts.items())}


def _area(size: str) -> int:
    width, _, height = size.partition("x")
    return int(width) * int(height)
