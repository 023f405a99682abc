"""preflight.json: the pre-launch checklist's report (pydantic, with its JSON Schema).

Infinity and NaN (PSNR of identical images is infinite) are written as the strings "Infinity", "-Infinity" and
"NaN", as in parity.json.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from ..parity.report.model import MetricFloat

PREFLIGHT_SCHEMA_VERSION = 1

Status = Literal["pass", "fail", "n/a"]
_NON_FINITE = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _non_finite(value):
    return _NON_FINITE.get(value, value) if isinstance(value, str) else value


# A measured figure; "Infinity" / "-Infinity" / "NaN" read back as floats.
Figure = Annotated[MetricFloat | int | bool | str | None, BeforeValidator(_non_finite)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")


class CheckResult(_Model):
    name: str = Field(description="the check's name (what --only / --skip take)")
    title: str
    status: Status = Field(description="pass | fail | n/a (not applicable here: `reason` says why)")
    summary: str = Field(description="one line: the headline figure against its threshold")
    figures: dict[str, Figure] = Field(default_factory=dict, description="what was measured")
    thresholds: dict[str, Figure] = Field(default_factory=dict, description="what it was judged against")
    rows: list[dict[str, Figure]] = Field(default_factory=list, description="per bucket / request / image")
    failures: list[str] = Field(default_factory=list, description="every reason the check failed")
    notes: list[str] = Field(default_factory=list)
    reason: str | None = Field(None, description="why the check (or a part of it) is n/a")
    seconds: float = Field(ge=0)
    timeout_s: float = Field(gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> CheckResult:
        if (self.status == "fail") != bool(self.failures):
            raise ValueError("status is 'fail' exactly when failures are given")
        if self.status == "n/a" and not self.reason:
            raise ValueError("an n/a check says why (reason)")
        return self

    @property
    def passed(self) -> bool:
        return self.status != "fail"


class DeploymentInfo(_Model):
    kind: Literal["served", "in-process"]
    pipeline: str
    url: str | None = None
    protocol: str | None = None
    started_by_preflight: bool = False
    instances: int | None = None
    max_queue_size: int | None = None
    buckets: list[str] = Field(default_factory=list)
    controlnets: list[str] = Field(default_factory=list)
    engine_keys: list[str] = Field(default_factory=list)


class PreflightReport(_Model):
    schema_version: Literal[1] = PREFLIGHT_SCHEMA_VERSION
    created_at: datetime
    tool_versions: dict[str, str] = Field(default_factory=dict)
    config: str = Field(description="the engines.yaml checked")
    model: str
    target: str
    deployment: DeploymentInfo
    checks: list[CheckResult] = Field(description="in the checklist's order")
    not_run: list[str] = Field(default_factory=list, description="checks left out by --only / --skip")
    passed: bool = Field(description="at least one check ran and none failed")

    @model_validator(mode="after")
    def _verdict(self) -> PreflightReport:
        names = [c.name for c in self.checks]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate checks: {names}")
        if self.passed != (bool(self.checks) and all(c.passed for c in self.checks)):
            raise ValueError("passed must say whether every check passed")
        return self

    @classmethod
    def build(cls, *, config: str, model: str, target: str, deployment: dict[str, Any], checks: list[CheckResult],
              not_run: list[str]) -> PreflightReport:
        from ..parity.report.judge import collect_tool_versions

        return cls(created_at=datetime.now(UTC), tool_versions=collect_tool_versions(), config=config,
                   model=model, target=target, deployment=DeploymentInfo(**deployment), checks=checks,
                   not_run=not_run, passed=bool(checks) and all(c.passed for c in checks))

    def check(self, name: str) -> CheckResult:
        return next(c for c in self.checks if c.name == name)
