"""What every check gets (CheckContext) and how it reports (Outcome -> CheckResult)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...engines_file import EnginesConfig
from ...engines_file.preflight import PreflightSettings
from ...sample_inputs import natural_workflow, workflow_inputs
from ...triton.client import ImageRequest
from ...workflows import Workflow
from ..deployment import Deployment

PROMPT = "a lighthouse on a cliff at dusk"
STRENGTH = 0.6  # img2img/inpaint requests of the checks: most of the schedule, from a recognisable start


@dataclass
class CheckContext:
    config: EnginesConfig
    model: str
    target: str
    settings: PreflightSettings
    deployment: Deployment
    engines: Any  # connect.Engines: what the workspace holds for this model and target
    baseline: Any = None  # baseline.Baseline, loaded before the server started (quality)
    save_baseline: bool = False
    deadline: float = float("inf")  # time.monotonic() by which the running check must end
    saved: dict[str, Any] = field(default_factory=dict)  # what a check leaves for the run (the new baseline)

    @property
    def resolved_model(self):
        return self.config.models[self.model]

    @property
    def workflows(self) -> tuple[Workflow, ...]:
        """The workflows engines.yaml declares for the model: the checks that run per workflow loop over them."""
        return self.resolved_model.workflows

    @property
    def natural_workflow(self) -> Workflow:
        """What the checks that are not about workflows send: txt2img where the model serves it, else the first
        one it declares (an image-to-video checkpoint serves img2vid alone: a txt2img request would be refused)."""
        return natural_workflow(self.workflows)

    def remaining(self, floor: float = 1.0) -> float:
        """Seconds left before the check's timeout (at least `floor`): the bound for a request's own timeout."""
        return max(floor, self.deadline - time.monotonic())

    def request(self, size=None, workflow: Workflow | None = None, **values) -> ImageRequest:
        """An ImageRequest at `size` (the first bucket's) for `workflow` (default: the model's natural one); an
        image workflow's gets the seeded init image (and mask) of its seed, at the size, and the checks' strength."""
        size = size or self.deployment.buckets[0].request
        workflow = workflow or self.natural_workflow
        fields = dict(prompt=PROMPT, height=size.height, width=size.width, steps=4, guidance_scale=7.5, seed=0,
                      frames=size.frames or None)  # a video bucket's clip length
        fields.update(values)
        fields.update(workflow_fields(workflow, size.height, size.width, fields["seed"]))
        return ImageRequest(**fields)

    def generate(self, request: ImageRequest, timeout_s: float | None = None) -> np.ndarray:
        return self.deployment.generate(request, min(timeout_s or 600.0, self.remaining()))


@dataclass
class Outcome:
    """What a check measured; the runner turns it into a CheckResult (adding seconds and timeout)."""

    summary: str
    figures: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    reason: str | None = None  # set with not_applicable
    not_applicable: bool = False

    @property
    def status(self) -> str:
        if self.failures:
            return "fail"
        return "n/a" if self.not_applicable else "pass"


def not_applicable(reason: str, **figures) -> Outcome:
    return Outcome(summary=f"n/a: {reason}", figures=figures, reason=reason, not_applicable=True)


@dataclass(frozen=True)
class Check:
    name: str
    title: str
    run: Callable[[CheckContext], Outcome]


def workflow_fields(workflow: Workflow, height: int, width: int, seed: int) -> dict:
    """The request fields of a workflow: none for txt2img (its requests stay as before workflows)."""
    if workflow is Workflow.txt2img:
        return {}
    fields = {"workflow": workflow.value, **workflow_inputs(workflow, height, width, seed)}
    if workflow.takes_strength:
        fields["strength"] = STRENGTH
    return fields


def workflow_label(workflow: Workflow) -> str:
    """'' for txt2img (its rows and messages read as before), else ' (img2img)'."""
    return "" if workflow is Workflow.txt2img else f" ({workflow.value})"


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int64) - b.astype(np.int64)).max()) if a.shape == b.shape else 255


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def seconds_text(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"
