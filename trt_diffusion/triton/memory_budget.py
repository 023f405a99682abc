"""The memory a repository's models are estimated to take once served, per model, and the budget the set must fit
(`package --memory-budget-gb`, default engines.yaml's `preflight: memory: max_rss_gb`; `serve --memory-budget-gb` checks the
recorded estimate again on the host that serves it).

The estimate is what loading costs: every engine model's packaged bytes once per instance (weights are resident
whatever the runtime), plus each python-backend instance (a stub process with torch imported, about 250 MB:
docs/triton.md), plus, for an engine serving LoRAs per request, a copy of its weights per LoRA set its instance may
keep applied (`--lora-cache-sets`; measured about one weight copy per set: docs/benchmarks.md), plus a TensorRT
engine's activation memory per instance as it is served: one context per listed optimization profile under Triton's
TensorRT backend (each its own profile's size with ON_PROFILE_CHANGE, the largest of all with STATIC), one context
in trt-diffusion's runner (targets/tensorrt/served_memory.py; the manifest records the sizes). Other targets'
activations come on top; preflight's load check measures the real peak."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ServeError
from ..targets.lora_switch import FOLDER as LORA_FOLDER

GB = 1e9
PYTHON_PROCESS_GB = 0.25


@dataclass(frozen=True)
class MemoryShare:
    model: str  # the pipeline (entry) name
    engines_gb: float  # engine bytes x engine instances
    processes: int  # python-backend instances
    total_gb: float
    activations_gb: float = 0.0  # TensorRT activation memory x engine instances (in total_gb)

    def describe(self) -> str:
        activations = f" + activations {self.activations_gb:.2f} GB" if self.activations_gb else ""
        return (f"{self.model} {self.total_gb:.2f} GB (engines {self.engines_gb:.2f} GB{activations} + "
                f"{self.processes} python processes x {PYTHON_PROCESS_GB} GB)")


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _engine_bytes(folder: Path, options: Any) -> int:
    """An engine model's bytes once loaded: its files, and where it serves LoRAs per request, one more copy of its
    weights (the files but the parts) per set the LRU keeps."""
    total = _folder_bytes(folder)
    parts = [_folder_bytes(version / LORA_FOLDER) for version in folder.iterdir() if (version / LORA_FOLDER).is_dir()]
    if not parts:
        return total
    return total + (total - sum(parts)) * options.lora_cache_sets


def _activation_bytes(folder: Path, backend: str) -> int:
    """An engine model's activation memory per instance, as its target (config.pbtxt's `target`) counts it."""
    import re

    from ..targets import get_target

    try:
        config = (folder / "config.pbtxt").read_text()
    except OSError:
        return 0
    found = re.search(r'key:\s*"target"\s*value\s*:?\s*\{\s*string_value:\s*"([\w.-]+)"', config)
    if not found:
        return 0
    try:
        return get_target(found.group(1)).served_activation_bytes(folder, backend)
    except Exception:  # noqa: BLE001 - a target this host cannot load: its activations are not estimated
        return 0


def _instances(model: Any, options: Any) -> int:
    """Python processes of one packaged model: entry and denoise stage per --instances, engines per
    --engine-instances (python backend only), the other stages and the stream one each, ensembles none."""
    if model.backend != "python":
        return 0
    if model.role == "entry" or model.name.endswith("_denoise"):
        return options.pipeline_instances
    return options.engine_instances if model.role == "engine" else 1


def shares(repo: Path, reports: Sequence[Any], options: Any) -> list[MemoryShare]:
    """One share per model of the repository at `repo` (its engine model folders measured as written)."""
    result = []
    for report in reports:
        engine_bytes = sum(_engine_bytes(Path(repo) / m.name, options) for m in report.models if m.role == "engine")
        engines_gb = engine_bytes * options.engine_instances / GB
        activation_bytes = sum(_activation_bytes(Path(repo) / m.name, m.backend) for m in report.models
                               if m.role == "engine")
        activations_gb = activation_bytes * options.engine_instances / GB
        processes = sum(_instances(m, options) for m in report.models)
        result.append(MemoryShare(report.entry, round(engines_gb, 4), processes,
                                  round(engines_gb + activations_gb + processes * PYTHON_PROCESS_GB, 4),
                                  round(activations_gb, 4)))
    return result


def check(shares: Sequence[MemoryShare], budget_gb: float | None) -> None:
    """Refuse a set of models whose estimated total exceeds the budget, naming each model's share."""
    if budget_gb is None:
        return
    if not budget_gb > 0:
        raise ServeError(f"--memory-budget-gb must be positive, got {budget_gb}")
    total = sum(share.total_gb for share in shares)
    if total > budget_gb:
        raise ServeError(f"the models need an estimated {total:.2f} GB once served, above the {budget_gb:g} GB "
                         f"memory budget (--memory-budget-gb): " + "; ".join(s.describe() for s in shares)
                         + ". Package fewer models, fewer instances, or raise the budget")
