"""PackageReport: what `package` wrote, kept at the repository's root (Triton ignores files there)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ServeError

FILE_NAME = "trt_diffusion_package.json"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class PackagedModel:
    name: str
    role: str  # entry | stage | ensemble | engine
    backend: str  # python | onnxruntime | tensorrt_plan | ensemble
    component: str | None = None
    bucket: str | None = None
    batch: int | None = None
    controlnet: str | None = None
    warmup_samples: int = 0
    source: str | None = None  # the engine folder or plan it was copied from


@dataclass
class PackageReport:
    repo: str
    pipeline: str
    entry: str  # the public model: the whole generation, cancellable
    ensemble: str | None  # the same contract as encode -> denoise -> decode stages
    family: str
    target: str
    sizes: list[str]  # the denoiser's buckets, as labels
    request_sizes: list[str]  # one servable size per bucket (its opt): what a warm-up request asks for
    controlnets: list[str]
    models: list[PackagedModel]
    options: dict
    seconds: float
    schema_version: int = SCHEMA_VERSION
    notes: list[str] = field(default_factory=list)
    workflows: list[str] = field(default_factory=lambda: ["txt2img"])  # what the entry serves (engines.yaml)
    cfg: list[str] = field(default_factory=list)  # engines.yaml's CFG modes (parallel: two denoiser instances)
    loras: list[str] = field(default_factory=list)  # the LoRAs a request may name in LORAS (refit, per request)
    # A repository of several models: every model's own report (as dicts; this one's fields are the first's, its
    # `models` every Triton model of the repository). Empty for one model.
    pipelines: list[dict] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)  # each model's estimated share (memory_budget.MemoryShare)

    def all_pipelines(self) -> list[PackageReport]:
        """Every model's report: this one alone, or one per model of a repository of several."""
        if not self.pipelines:
            return [self]
        return [PackageReport(**{**raw, "models": [m if isinstance(m, PackagedModel) else PackagedModel(**m)
                                                   for m in raw["models"]]}) for raw in self.pipelines]

    def engine_models(self) -> list[PackagedModel]:
        return [m for m in self.models if m.role == "engine"]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)

    def write(self, repo: Path) -> None:
        (Path(repo) / FILE_NAME).write_text(self.to_json())

    @classmethod
    def read(cls, repo: str | Path) -> PackageReport:
        path = Path(repo) / FILE_NAME
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            raise ServeError(f"{repo} is not a repository written by `trt-diffusion package` (no readable "
                             f"{FILE_NAME}); run `trt-diffusion package engines.yaml --out {repo}`") from None
        if raw.get("schema_version") != SCHEMA_VERSION:
            raise ServeError(f"{path} has schema_version {raw.get('schema_version')!r}; package again")
        raw["models"] = [PackagedModel(**m) for m in raw["models"]]
        return cls(**raw)
