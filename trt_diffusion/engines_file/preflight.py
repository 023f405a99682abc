"""The `preflight:` block of engines.yaml: thresholds, budgets and timeouts of the pre-launch checklist.

Every field has a default, so the block is optional; unknown keys are refused with file:line like the rest of
the file. `preflight/` reads these; the meaning of each figure is in docs/preflight.md.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_QUALITY_PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a watercolor painting of a quiet harbor at dawn",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Check(_Strict):
    timeout_s: float = Field(120.0, gt=0, le=3600, description="the check fails when it runs longer")


class ReproducibilitySettings(_Check):
    steps: int = Field(6, ge=1, le=1000)
    seed: int = 1234


class BucketSettings(_Check):
    steps: int = Field(20, ge=1, le=1000, description="steps of each bucket's first request")
    max_first_request_s: float = Field(30.0, gt=0, description="a bucket's first request after start may take this")


class MemorySettings(_Check):
    max_rss_gb: float = Field(16.0, gt=0, description="CPU memory budget: peak RSS (or used memory) under load")
    max_gpu_gb: float | None = Field(None, gt=0, description="GPU memory budget, where GPU memory is reported")
    concurrency: int | None = Field(None, ge=1, description="requests at once; default: the entry's instances")
    requests: int = Field(4, ge=1, le=1000)
    steps: int = Field(8, ge=1, le=1000)


class IsolationSettings(_Check):
    requests: int = Field(8, ge=2, le=256)
    concurrency: int = Field(4, ge=2, le=64)
    steps: tuple[int, ...] = Field((4, 7), min_length=1, description="cycled over the requests")


class CancellationSettings(_Check):
    steps: int = Field(1000, ge=10, le=1000, description="a request only a cancellation can end early")
    deadline_s: float = Field(0.5, gt=0, description="the client's deadline on that request")
    max_memory_growth_mb: float = Field(256.0, ge=0, description="memory after cancellation vs before")


class PluginSettings(_Check):
    steps: int = Field(4, ge=1, le=1000)
    min_change: float = Field(1.0, ge=0, description="mean |with - without| in grey levels a plugin must cause")
    min_mean: float = Field(2.0, ge=0, description="an image darker than this mean grey level is black")


class QualitySettings(_Check):
    prompts: tuple[str, ...] = Field(DEFAULT_QUALITY_PROMPTS, min_length=1)
    seeds: tuple[int, ...] = Field((0, 1), min_length=1)
    steps: int = Field(8, ge=1, le=1000)
    guidance_scale: float = Field(7.5, ge=0, le=100)
    min_psnr_db: float = Field(30.0, ge=0)
    min_ssim: float = Field(0.95, ge=-1, le=1)
    max_lpips: float | None = Field(None, ge=0)
    baseline: str | None = Field(None, description="baseline folder; default <workspace>/preflight/baseline/<model>")


class OverloadSettings(_Check):
    steps: int = Field(20, ge=1, le=1000)
    capacity_s: float = Field(3.0, gt=0, le=120, description="closed-loop seconds per concurrency level")
    duration_s: float = Field(10.0, gt=0, le=600, description="seconds of open-loop arrivals (bounded)")
    load_factor: float = Field(1.5, gt=1, le=10, description="arrival rate over the measured capacity")
    request_timeout_s: float = Field(60.0, gt=0, description="a request not answered by then has hung")
    max_refusal_s: float = Field(1.0, gt=0, description="P99 latency of a refusal")
    max_accepted_p99_s: float | None = Field(None, gt=0, description="P99 latency of accepted requests (an SLO); "
                                             "null: reported, not gated")
    max_latency_growth: float = Field(1.5, gt=1, description="median wait of the last quarter's arrivals over the "
                                      "second quarter's: above it, waits grow without bound")
    timeout_s: float = Field(180.0, gt=0, le=3600)


class PreflightSettings(_Strict):
    model: str | None = Field(None, description="the model to check; default: the only one")
    target: str = Field("onnxruntime", description="whose built engines are served")
    out: str | None = Field(None, description="report folder; default <workspace>/reports/preflight")
    ready_timeout_s: float = Field(600.0, gt=0, description="a server preflight starts must be ready by then")
    reproducibility: ReproducibilitySettings = ReproducibilitySettings()
    buckets: BucketSettings = BucketSettings()
    memory: MemorySettings = MemorySettings()
    isolation: IsolationSettings = IsolationSettings()
    cancellation: CancellationSettings = CancellationSettings()
    plugins: PluginSettings = PluginSettings()
    quality: QualitySettings = QualitySettings()
    overload: OverloadSettings = OverloadSettings()

    def check(self, name: str) -> _Check:
        return getattr(self, name)
