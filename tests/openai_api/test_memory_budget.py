"""The served-memory estimate of a repository's models and the budget check that names each model's share."""

from __future__ import annotations

from pathlib import Path

import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.triton import memory_budget
from trt_diffusion.triton.report import PackagedModel, PackageReport
from trt_diffusion.triton.repository import PackageOptions


def report(entry: str, engine_bytes: dict[str, int], repo: Path) -> PackageReport:
    models = [PackagedModel(entry, "entry", "python"), PackagedModel(f"{entry}_denoise", "stage", "python"),
              PackagedModel(f"{entry}_stream", "stream", "python"), PackagedModel(f"{entry}_ensemble", "ensemble",
                                                                                  "ensemble")]
    for name, size in engine_bytes.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.onnx").write_bytes(b"\0" * size)
        models.append(PackagedModel(name, "engine", "python"))
    return PackageReport(str(repo), entry, entry, None, "sd15", "onnxruntime", ["64x64"], ["64x64"], [], models, {},
                         0.0)


def test_shares_count_engine_bytes_per_instance_and_python_processes(tmp_path):
    reports = [report("a", {"a__unet": 3_000_000, "a__vae": 1_000_000}, tmp_path),
               report("b", {"b__unet": 500_000}, tmp_path)]
    options = PackageOptions(pipeline_instances=2, engine_instances=2)
    a, b = memory_budget.shares(tmp_path, reports, options)
    assert (a.model, a.engines_gb, a.processes) == ("a", 0.008, 2 + 2 + 1 + 2 * 2)  # entry, denoise, stream, engines
    assert a.total_gb == pytest.approx(0.008 + 9 * memory_budget.PYTHON_PROCESS_GB)
    assert (b.engines_gb, b.processes) == (0.001, 2 + 2 + 1 + 2)
    memory_budget.check([a, b], None)  # no budget: nothing checked
    memory_budget.check([a, b], a.total_gb + b.total_gb)
    with pytest.raises(ServeError) as caught:
        memory_budget.check([a, b], 3.0)
    assert str(caught.value).startswith(f"the models need an estimated {a.total_gb + b.total_gb:.2f} GB once served, "
                                        "above the 3 GB memory budget (--memory-budget-gb): a 2.26 GB (engines "
                                        "0.01 GB + 9 python processes x 0.25 GB); b 1.75 GB")
    with pytest.raises(ServeError, match="--memory-budget-gb must be positive, got 0"):
        memory_budget.check([a], 0)


def test_a_report_lists_every_models_report(tmp_path):
    one = report("a", {"a__unet": 10}, tmp_path)
    assert one.all_pipelines() == [one]
    two = report("b", {"b__unet": 10}, tmp_path)
    from dataclasses import asdict

    one.pipelines = [asdict(one), asdict(two)]
    one.write(tmp_path)
    back = PackageReport.read(tmp_path)
    assert [p.entry for p in back.all_pipelines()] == ["a", "b"]
    assert back.all_pipelines()[1].models[-1] == PackagedModel("b__unet", "engine", "python")


def test_an_engine_serving_loras_counts_a_weight_copy_per_cached_set(tmp_path):
    (served,) = [report("a", {"a__unet": 2_000_000}, tmp_path)]
    parts = tmp_path / "a__unet" / "1" / "loras"
    parts.mkdir()
    (parts / "lora-style.safetensors").write_bytes(b"\0" * 500_000)  # the parts: on disk, not a cached set
    options = PackageOptions(lora_cache_sets=3)
    (share,) = memory_budget.shares(tmp_path, [served], options)
    assert share.engines_gb == pytest.approx((2_500_000 + 3 * 2_000_000) / memory_budget.GB)
