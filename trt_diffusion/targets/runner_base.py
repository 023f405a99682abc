"""One runner base for every backend, as Polygraphy's `BaseRunner`: a runner is a lifecycle.

`runner = target.runner(engine)` builds the object; `with runner:` (or `activate()`) allocates what it holds
for its life, once; `run(feeds)` checks names, dtypes and shapes against `inputs` and says what it expected — a
wrong feed is one clear `RuntimeInputError`, not a backend's stack trace, and nothing is loaded for it — then
calls the subclass's `_run` while the runner is in use; `deactivate()` frees. A runner used without `with` is
activated on its first `run`.

A subclass implements `_run` and, where it holds resources, `_activate`/`_deactivate`; one whose inputs say more
than `inputs` can (TensorRT: the profile's shape ranges) overrides `_check_feeds`, and one shared with other
runners (TensorRT: a group's stream and lock) overrides `_in_use`, what holds while one run executes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any, Protocol

import numpy as np

from ..errors import RuntimeInputError
from ..tensors import TensorSpec, is_fixed

# The optimization profile the runtime routed the current call to (a multi-profile TensorRT engine serves several
# buckets and batches: runtime/engines.py's RunnerTable names which one a request's shape is for). Per thread and
# task, so wrappers around a runner (padding, probes) pass it through untouched; runners with one profile ignore it.
ROUTED_PROFILE: ContextVar[int | None] = ContextVar("trt_diffusion_routed_profile", default=None)


@contextlib.contextmanager
def routed_profile(index: int | None) -> Iterator[None]:
    """Calls inside run in optimization profile `index` of a multi-profile engine, where it holds their shapes."""
    token = ROUTED_PROFILE.set(index)
    try:
        yield
    finally:
        ROUTED_PROFILE.reset(token)


class Runner(Protocol):
    """What the pipeline and the Triton models call: any object with these (a BaseRunner, a wrapper of one)."""

    name: str
    inputs: dict[str, TensorSpec]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


def check_feeds(name: str, inputs: dict[str, TensorSpec], feeds: dict[str, np.ndarray]) -> None:
    missing = [k for k in inputs if k not in feeds]
    extra = [k for k in feeds if k not in inputs]
    problems = []
    if missing:
        problems.append(f"missing input(s) {missing}")
    if extra:
        problems.append(f"unexpected input(s) {extra}")
    for key, spec in inputs.items():
        if key not in feeds:
            continue
        value = feeds[key]
        if np.dtype(value.dtype).name != spec.dtype:
            problems.append(f"{key}: dtype {np.dtype(value.dtype).name}, expected {spec.dtype}")
        if len(value.shape) != len(spec.shape) or any(
            is_fixed(want) and got != want for got, want in zip(value.shape, spec.shape)
        ):
            problems.append(f"{key}: shape {list(value.shape)}, expected {spec.describe()}")
    if problems:
        expected = ", ".join(f"{k} {s.describe()}" for k, s in inputs.items())
        raise RuntimeInputError(f"{name}: {'; '.join(problems)} (expects: {expected})")


class BaseRunner:
    """The lifecycle every runner shares. Subclasses set `name` and `inputs` and implement `_run` (and, where they
    hold resources, `_activate`/`_deactivate`; see the module's docstring for `_check_feeds` and `_in_use`)."""

    name: str
    inputs: dict[str, TensorSpec]

    @property
    def active(self) -> bool:
        return getattr(self, "_active", False)

    def activate(self) -> None:
        if not self.active:
            self._activate()
            self._active = True

    def deactivate(self) -> None:
        if self.active:
            self._deactivate()
            self._active = False

    def __enter__(self):
        self.activate()
        return self

    def __exit__(self, *exc_info) -> None:
        self.deactivate()

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        self._check_feeds(feeds)
        with self._in_use():
            return self._run(feeds)

    def _check_feeds(self, feeds: Mapping[str, Any]) -> None:
        """RuntimeInputError unless the feeds match `inputs` (names, dtypes, ranks and fixed sizes)."""
        check_feeds(self.name, self.inputs, feeds)

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[None]:
        """What holds while one run executes: the runner active (activated on its first run)."""
        self.activate()
        yield

    def _activate(self) -> None:
        """Allocate what the runner holds while active (nothing by default)."""

    def _deactivate(self) -> None:
        """Free what `_activate` allocated."""

    def _run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError
