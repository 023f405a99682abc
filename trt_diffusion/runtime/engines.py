"""Which runner serves a component at a given size and batch: routing a request to its bucket's engines.

A multi-profile engine (TensorRT's `engine_layout: profiles`) has one entry per profile: its bucket and batch,
the one runner, and the profile's index. `route` answers (runner, profile); `find` hands out the runner bound to
that profile (`ProfileRunner`: the engine runs the request in the profile built for its shape). An entry may hold
further runners over the same engine (`instances`: `cfg: parallel` runs a step's two CFG calls on two at once,
runtime/cfg_parallel.py); `find(..., instance=i)` hands out the i-th, the one runner where there is no other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engines_file.engine_spec import Bucket, Size
from ..errors import RuntimeInputError
from ..targets.runner_base import Runner, routed_profile

MAX_DYNAMIC_ROWS = 8  # requests' rows per denoiser call where the engine's batch is dynamic


@dataclass(frozen=True)
class RunnerEntry:
    component: str
    runner: Runner
    bucket: Bucket | None = None  # None: any size (text encoders, the torch reference)
    batch: int | None = None  # None: any batch
    controlnet: str | None = None
    profile: int | None = None  # the optimization profile of a multi-profile engine built for this bucket/batch
    instances: tuple[Runner, ...] = ()  # more runners over the same engine, for calls at once (cfg: parallel)

    def instance(self, index: int) -> Runner:
        runners = (self.runner, *self.instances)
        return runners[index % len(runners)]


@dataclass(frozen=True)
class Route:
    """Where a request of one component, size and batch runs: the entry's runner, in its profile."""

    runner: Runner
    profile: int | None
    batch: int | None  # the engine's batch (larger than the request's when its rows are padded)
    entry: RunnerEntry | None = None  # where the runner came from (its other instances)


class RunnerTable:
    def __init__(self, entries: list[RunnerEntry] | None = None):
        self.entries: list[RunnerEntry] = list(entries or [])

    def add(self, component: str, runner: Runner, *, bucket: Bucket | None = None, batch: int | None = None,
            controlnet: str | None = None, profile: int | None = None, instances: tuple[Runner, ...] = ()) -> None:
        self.entries.append(RunnerEntry(component, runner, bucket, batch, controlnet, profile, tuple(instances)))

    def has(self, component: str, controlnet: str | None = None) -> bool:
        return any(e.component == component and e.controlnet == controlnet for e in self.entries)

    def batches(self, component: str, size: Size | None) -> set[int | None]:
        return {e.batch for e in self._covering(component, size, None)}

    def find(self, component: str, *, size: Size | None, batch: int, controlnet: str | None = None,
             instance: int = 0) -> Runner:
        """The runner for a call of `batch` rows at `size`; `instance` picks one of the entry's runners over the same
        engine (calls made at once on different instances run at once; an entry with one runner gives it always)."""
        route = self.route(component, size=size, batch=batch, controlnet=controlnet)
        runner = route.runner if route.entry is None else route.entry.instance(instance)
        if route.batch is not None and route.batch > batch:  # e.g. a no-CFG request (guidance <= 1) on a
            runner = BatchPaddedRunner(runner, batch, route.batch)  # `cfg: batched` build's batch-2 engines
        return runner if route.profile is None else ProfileRunner(runner, route.profile)

    def route(self, component: str, *, size: Size | None, batch: int, controlnet: str | None = None) -> Route:
        """The engine (and, for a multi-profile one, the profile) a call of `batch` rows at `size` runs in."""
        candidates = self._covering(component, size, controlnet)
        if not candidates:
            supported = self.supported_sizes(component, controlnet)
            raise RuntimeInputError(
                f"no {component}{f' ({controlnet})' if controlnet else ''} engine covers {size}; "
                f"supported sizes: {', '.join(supported) or 'none built'}")
        for entry in candidates:
            if entry.batch in (None, batch):
                return Route(entry.runner, entry.profile, entry.batch, entry)
        larger = sorted((e for e in candidates if e.batch is not None and e.batch > batch), key=lambda e: e.batch)
        if larger:
            return Route(larger[0].runner, larger[0].profile, larger[0].batch, larger[0])
        have = sorted(e.batch for e in candidates if e.batch is not None)
        raise RuntimeInputError(f"no {component} engine for batch {batch} at {size}; built batches: {have}")

    def largest_batch(self, component: str, size: Size | None) -> int | None:
        """The largest fixed batch among the engines covering `size`; None when one takes any batch."""
        batches = self.batches(component, size)
        return None if None in batches or not batches else max(batches)

    def supported_sizes(self, component: str, controlnet: str | None = None) -> list[str]:
        labels = [e.bucket.label for e in self.entries
                  if e.component == component and e.controlnet == controlnet and e.bucket is not None]
        return list(dict.fromkeys(labels))

    def _covering(self, component, size, controlnet) -> list[RunnerEntry]:
        # Static buckets first: an exact-shape engine beats a range engine that also covers the size.
        found = [e for e in self.entries if e.component == component and e.controlnet == controlnet
                 and (e.bucket is None or size is None or e.bucket.covers(size))]
        return sorted(found, key=lambda e: (e.bucket is None, not (e.bucket and e.bucket.is_static)))


class ProfileRunner:
    """One optimization profile of a multi-profile engine: calls run in the profile the table routed their bucket
    and batch to (`routed_profile`; the runner falls back to the tightest profile holding the shapes)."""

    def __init__(self, runner: Runner, profile: int):
        self.runner, self.profile = runner, profile
        self.name = f"{runner.name} (profile {profile})"
        self.inputs = runner.inputs
        self.device_tensors = getattr(runner, "device_tensors", False)

    def run(self, feeds):
        with routed_profile(self.profile):
            return self.runner.run(feeds)


class BatchPaddedRunner:
    """A fixed-batch engine serving fewer rows: the feeds are padded with copies of their last row and the
    outputs cut back to the rows asked for. It costs a full-batch call, so a no-CFG request (guidance <= 1) on a
    `cfg: batched` build runs at the cost of a CFG step; `cfg: split` builds the batch-N engines that serve it
    at full speed (docs/triton.md). Feeds are numpy arrays, or torch tensors on the device path."""

    def __init__(self, runner: Runner, rows: int, batch: int):
        self.runner, self.rows, self.batch = runner, rows, batch
        self.name = f"{runner.name} (batch {batch}, {rows} row{'s' if rows > 1 else ''} used)"
        self.inputs = runner.inputs
        self.device_tensors = getattr(runner, "device_tensors", False)

    def run(self, feeds):
        padded = {name: _pad_rows(value, self.rows, self.batch) for name, value in feeds.items()}
        outputs = self.runner.run(padded)
        return {name: value[:self.rows] if _leading(value) == self.batch else value for name, value in outputs.items()}


def _leading(value) -> int | None:
    shape = getattr(value, "shape", ())
    return shape[0] if len(shape) else None


def _pad_rows(value, rows: int, batch: int):
    if _leading(value) != rows:
        return value  # not batch-major (a scalar input): as it is
    if isinstance(value, np.ndarray):
        return np.concatenate([value, np.repeat(value[-1:], batch - rows, axis=0)])
    import torch

    return torch.cat([value, value[-1:].expand(batch - rows, *value.shape[1:])])


def split_cfg_mode(runners: RunnerTable, size, rows: int, family: str, calls: str) -> str:
    """`split` where the transformer engines serve the request's rows: true CFG as diffusers' two calls over those
    rows, the only mode that is the pipeline's computation (engines built only at twice the rows are refused, not
    guessed at). `calls` says what the two calls are, for the message."""
    batches = runners.batches("transformer", size)
    if None in batches or rows in batches:
        return "split"
    raise RuntimeInputError(
        f"no transformer engine at {size} for batch {rows}: {family}'s true CFG runs {calls} as two calls of {rows} "
        f"row(s) (build `cfg: [split]`); built: {sorted(b for b in batches if b)}")
