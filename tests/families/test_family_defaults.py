"""Defaults that serve (#42): for every declared family, the minimal engines.yaml (source, family, one bucket)
plans engines that cover the family's default request — its default components, a denoiser engine at the batch
its guidance calls it with, its declared default precisions on each target — and `plan` refuses, at the line, a
`cfg` whose engines its requests cannot run. A new family is tested by adding its declaration: these are
parametrised over the registry."""

from __future__ import annotations

import pytest
import yaml

from tests.families.plan_keys import BUCKETS, DEFAULT_BUCKET, family_names, minimal_engines_yaml
from trt_diffusion import api
from trt_diffusion.errors import ConfigError
from trt_diffusion.families import WIDE_FLOAT, CfgKind, Component, family_info
from trt_diffusion.target_registry import default_target_names, get_target


def _denoiser_rows(kind: CfgKind, cfg: tuple[str, ...]) -> set[int]:
    """The denoiser batches a one-image request with guidance calls, by the family's kind of guidance."""
    if kind is CfgKind.batched and "batched" in cfg:
        return {2}  # the prompt's and the negative prompt's rows in one call
    return {1}  # split/parallel CFG, true CFG and embedded guidance: calls over the request's own row


def _plan(tmp_path, tiny_model_factory, family):
    return api.plan(minimal_engines_yaml(tmp_path, tiny_model_factory(family), family), count_parameters=False)


@pytest.mark.parametrize("family", family_names())
def test_minimal_engines_yaml_covers_the_default_request(family, tiny_model_factory, tmp_path):
    info = family_info(family)
    plan = _plan(tmp_path, tiny_model_factory, family)
    bucket = BUCKETS.get(family, DEFAULT_BUCKET)
    for target in default_target_names():
        specs = [s for s in plan.specs if s.target == target]
        planned = {s.component for s in specs}
        assert set(info.default_components) <= planned, (target, planned)
        denoisers = {s.batch for s in specs if s.component == info.denoiser and s.bucket.label == bucket}
        wanted = _denoiser_rows(info.cfg_kind, info.default_cfg)
        assert wanted <= denoisers, f"{family} on {target}: denoiser batches {denoisers}, its request calls {wanted}"
        for spec in specs:
            declared = info.default_precision.get(spec.component)
            if declared is WIDE_FLOAT:  # bf16 where the target computes bf16 graphs, fp32 elsewhere
                bf16 = get_target(target).onnx_precision("bf16") == "bf16"
                assert spec.precision == (WIDE_FLOAT.on_bf16_targets if bf16 else WIDE_FLOAT.elsewhere), spec.name
            elif declared is not None:
                assert spec.precision == declared, spec.name
            elif not spec.component.is_vae:  # engines.yaml's file-wide fallback (fp32 VAEs, fp16 for the rest)
                # where the target computes fp16 on every host; OpenVINO's is fp32 (fp16 is native on few CPUs)
                assert spec.precision == get_target(target).fallback_precision(), spec.name


@pytest.mark.parametrize("family", family_names())
def test_every_default_openvino_engine_is_one_this_cpu_computes(family, tiny_model_factory, tmp_path):
    """OpenVINO refuses a precision the CPU does not compute (fp16 without AVX512-FP16/AMX-FP16, bf16 without
    AVX512-BF16/AMX): the minimal entry's engines must not need one, on any host (they were fp16 and refused on
    this AMD EPYC and every Xeon before Sapphire Rapids)."""
    from trt_diffusion.targets.openvino import host, precision

    if host.unavailable_reason() is not None:
        pytest.skip(host.unavailable_reason())
    facts = host.cpu_facts()
    for spec in _plan(tmp_path, tiny_model_factory, family).specs:
        if spec.target == "openvino":
            precision.resolve(spec.precision, facts.capabilities, facts.device_name)  # raises BuildError if refused


def test_flux_transformer_defaults_to_a_precision_that_passes_parity_on_cpu_targets(tiny_model_factory, tmp_path):
    """FLUX.1's fp16 transformer failed parity (0.037 > 0.02): fp32 on the CPU targets, bf16 on TensorRT."""
    plan = _plan(tmp_path, tiny_model_factory, "flux")
    precisions = {s.target: s.precision for s in plan.specs if s.component == Component.transformer}
    assert precisions == {"onnxruntime": "fp32", "openvino": "fp32", "tensorrt": "bf16"}


def test_parity_judges_each_target_on_the_precision_it_built(tiny_model_factory, tmp_path):
    """The FLUX.1 transformer's wide-float default is bf16 on TensorRT: parity judges that engine on bf16's bar,
    not on fp32's (the precision map holds the CPU targets' fp32)."""
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.parity.stage import judged_precision

    config = load_engines_file(minimal_engines_yaml(tmp_path, tiny_model_factory("flux"), "flux"))
    (model,) = config.models.values()
    assert [judged_precision(model, t).value for t in ("onnxruntime", "openvino", "tensorrt")] == \
        ["fp32", "fp32", "bf16"]


def test_qwen_image_default_cfg_builds_the_batch_one_transformer_true_cfg_calls(tiny_model_factory, tmp_path):
    plan = _plan(tmp_path, tiny_model_factory, "qwen_image")
    assert {s.batch for s in plan.specs if s.component == Component.transformer} == {1}


def _write(tmp_path, document) -> str:
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@pytest.mark.parametrize("family", [f for f in family_names() if family_info(f).cfg_kind is CfgKind.true_cfg])
def test_plan_refuses_batched_cfg_for_a_true_cfg_family_at_its_line(family, tiny_model_factory, tmp_path):
    model = {"source": str(tiny_model_factory(family)), "family": family, "buckets": [DEFAULT_BUCKET],
             "cfg": ["batched"]}
    path = _write(tmp_path, {"version": 1, "models": {"m": model}})
    with pytest.raises(ConfigError) as raised:
        api.plan(path, count_parameters=False)
    cfg_line = path.read_text().splitlines().index("    cfg:") + 1
    assert f"{path}:{cfg_line}: models.m.cfg: the {family} family runs true CFG" in str(raised.value)
    assert "['split']" in str(raised.value)


def test_plan_refuses_a_file_wide_batched_cfg_for_a_true_cfg_family_at_the_defaults(tiny_model_factory, tmp_path):
    path = _write(tmp_path, {"version": 1, "defaults": {"cfg": ["batched"]}, "models": {"m": {
        "source": str(tiny_model_factory("qwen_image")), "family": "qwen_image", "buckets": [DEFAULT_BUCKET]}}})
    with pytest.raises(ConfigError, match=r"defaults\.cfg: the qwen_image family runs true CFG"):
        api.plan(path, count_parameters=False)


@pytest.mark.parametrize("cfg", [["split"], ["batched", "split"], ["parallel"], ["none"]])
def test_plan_takes_a_true_cfg_family_cfg_that_serves(cfg, tiny_model_factory, tmp_path):
    path = _write(tmp_path, {"version": 1, "models": {"m": {
        "source": str(tiny_model_factory("qwen_image")), "family": "qwen_image", "buckets": [DEFAULT_BUCKET],
        "cfg": cfg}}})
    assert api.plan(path, count_parameters=False).specs


@pytest.mark.parametrize("family", [f for f in family_names() if family_info(f).cfg_kind is not CfgKind.true_cfg])
def test_plan_takes_batched_cfg_where_the_family_runs_it(family, tiny_model_factory, tmp_path):
    path = _write(tmp_path, {"version": 1, "models": {"m": {
        "source": str(tiny_model_factory(family)), "family": family, "buckets": [BUCKETS.get(family, DEFAULT_BUCKET)],
        "cfg": ["batched"]}}})
    assert api.plan(path, count_parameters=False).specs
