"""GPU architectures in the matrix: a dimension of tensorrt specs only (their keys and names change,
onnxruntime keys do not), shown by `plan`, and asked of Ray as a resource of the same name."""

from __future__ import annotations

import pytest
import yaml

from trt_diffusion import api
from trt_diffusion.engine_builds.ray_executor import task_resources
from trt_diffusion.engines_file import expand, load_engines_file
from trt_diffusion.errors import ConfigError
from trt_diffusion.targets import get_target


def _config(tmp_path, built_sd15, architectures):
    data = yaml.safe_load(built_sd15.read_text())
    data["models"]["sd15-tiny"]["targets"] = ["onnxruntime", "tensorrt"]
    if architectures is not None:
        data["build"]["tensorrt"] = {"architectures": architectures}
    path = tmp_path / f"engines-{len(architectures or [])}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_architectures_multiply_tensorrt_specs_only(tmp_path, built_sd15):
    plain = expand(load_engines_file(_config(tmp_path, built_sd15, None)))
    two = expand(load_engines_file(_config(tmp_path, built_sd15, ["sm_89", "sm_90"])))
    ort = lambda specs: sorted(s.key for s in specs if s.target == "onnxruntime")  # noqa: E731
    assert ort(plain) == ort(two)
    trt_plain = [s for s in plain if s.target == "tensorrt"]
    trt_two = [s for s in two if s.target == "tensorrt"]
    assert len(trt_two) == 2 * len(trt_plain)
    assert {s.option("architecture") for s in trt_two} == {"sm_89", "sm_90"}
    assert all(s.name.endswith((".sm_89", ".sm_90")) for s in trt_two)
    assert not {s.key for s in trt_two} & {s.key for s in trt_plain}


def test_plan_shows_the_architectures(tmp_path, built_sd15):
    plan = api.plan(_config(tmp_path, built_sd15, ["sm_89", "sm_90"]), count_parameters=False)
    rows = [r for r in plan.rows if r.target == "tensorrt"]
    assert rows and all("2 GPU architectures (sm_89, sm_90)" in r.formula for r in rows)


def test_a_tensorrt_task_asks_ray_for_its_architecture(tmp_path, built_sd15):
    config = load_engines_file(_config(tmp_path, built_sd15, ["sm_90"]))
    spec = next(s for s in expand(config) if s.target == "tensorrt")
    assert get_target("tensorrt").farm_needs(spec) == {"num_gpus": 1, "resources": {"sm_90": 1}}
    assert task_resources(config, spec) == {}


def test_an_architecture_that_is_not_sm_nn_is_a_config_error(tmp_path, built_sd15):
    with pytest.raises(ConfigError, match="architectures"):
        load_engines_file(_config(tmp_path, built_sd15, ["hopper"]))


def test_build_ray_without_ray_names_the_extra(monkeypatch):
    import builtins

    from trt_diffusion.engine_builds.ray_executor import require_ray
    from trt_diffusion.errors import MissingDependencyError

    real = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(MissingDependencyError, match=r"trt-diffusion\[farm\]"):
        require_ray()


def test_a_plan_for_another_architecture_is_left_to_a_host_that_has_it():
    from trt_diffusion.targets.tensorrt.versions import architecture_mismatch

    assert architecture_mismatch("sm_90", (9, 0)) is None
    assert architecture_mismatch("sm_90", (8, 9)) == "engines for sm_90 are built on an sm_90 GPU; this host has sm_89"
