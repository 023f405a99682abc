"""Check a written repository by reading it back: every config.pbtxt parses as Triton's ModelConfig, each
engine model's I/O equals its engine manifest, pipeline models match the serving contract and their
pipeline.json, and every ensemble is wired consistently. Problems are collected and reported together,
each naming the model and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ServeError
from ..targets.lora_switch import FOLDER as LORA_FOLDER
from ..targets.lora_switch import INDEX_FILE as LORA_INDEX
from . import configs, contract
from .configs import ROLE, ModelConfig
from .description import FILE_NAME as DESCRIPTION_FILE
from .description import SKELETON_DIR, PipelineDescription

VERSION = "1"


def read_configs(repo: Path) -> dict[str, ModelConfig]:
    found = {}
    for folder in sorted(Path(repo).iterdir()):
        if folder.is_dir() and not folder.name.startswith("."):
            path = folder / "config.pbtxt"
            if not path.is_file():
                raise ServeError(f"model {folder.name}: no config.pbtxt in {folder}")
            found[folder.name] = configs.parse(path.read_text(), f"model {folder.name}")
    return found


def validate_repository(repo: str | Path, manifests: dict[str, Any] | None = None) -> dict[str, ModelConfig]:
    """Raise ServeError listing every problem; return the parsed configs. `manifests` (model name -> engine
    manifest) are the source of truth when given, else each engine model's copied manifest.json."""
    repo = Path(repo)
    models = read_configs(repo)
    problems: list[str] = []
    for name, config in models.items():
        where = f"model {name}"
        if config.name != name:
            problems.append(f"{where}: field name is {config.name!r}, the folder is {name!r}")
        if not (repo / name / VERSION).is_dir():
            problems.append(f"{where}: version folder {VERSION}/ is missing")
        role = config.parameters[ROLE].string_value if ROLE in config.parameters else ""
        if role == "engine":
            manifest = (manifests or {}).get(name) or _copied_manifest(repo / name / VERSION)
            problems += _engine_problems(repo / name, config, manifest)
        elif role in ("entry", "stream", "stage"):
            problems += _pipeline_problems(repo / name, config, models)
        elif role == "ensemble":
            problems += _ensemble_problems(config, models)
        else:
            problems.append(f"{where}: parameter {ROLE} is {role!r}, expected entry, stream, stage, ensemble or "
                            "engine")
    for name in (manifests or {}):
        if name not in models:
            problems.append(f"model {name}: expected for a built engine, not in the repository")
    if problems:
        raise ServeError(f"the Triton repository {repo} is inconsistent:\n  " + "\n  ".join(problems))
    return models


# ---------------------------------------------------------------------------- helpers


def _required_files(config: ModelConfig) -> tuple[str, ...]:
    """A python model needs its model.py; any other backend the file its config names (the targets set
    `default_model_filename` for their Triton backends)."""
    if config.backend == "python":
        return ("model.py",)
    return (config.default_model_filename,) if config.default_model_filename else ()


def _copied_manifest(version: Path) -> Any:
    from types import SimpleNamespace

    try:
        raw = json.loads((version / "manifest.json").read_text())
    except (OSError, ValueError):
        return None

    def infos(items):
        return tuple(SimpleNamespace(name=t["name"], dtype=t["dtype"], shape=tuple(t["shape"])) for t in items)

    return SimpleNamespace(inputs=infos(raw.get("inputs", ())), outputs=infos(raw.get("outputs", ())))


def _io_problems(where: str, kind: str, declared, expected: dict[str, tuple[str, tuple[int, ...], bool]],
                 source: str) -> list[str]:
    """`declared`: config tensors; `expected`: name -> (TYPE_*, dims, optional)."""
    problems = []
    have = {t.name: t for t in declared}
    for name in expected.keys() - have.keys():
        problems.append(f"{where}: {kind} {name!r} is missing ({source} has it)")
    for name in have.keys() - expected.keys():
        problems.append(f"{where}: {kind} {name!r} is not in {source}")
    for name in expected.keys() & have.keys():
        tensor, (data_type, dims, optional) = have[name], expected[name]
        if configs.type_name(tensor.data_type) != data_type:
            problems.append(f"{where}: {kind} {name!r} data_type is {configs.type_name(tensor.data_type)}, "
                            f"{source} says {data_type}")
        if tuple(tensor.dims) != tuple(dims):
            problems.append(f"{where}: {kind} {name!r} dims are {list(tensor.dims)}, {source} says {list(dims)}")
        if kind == "input" and bool(tensor.optional) != optional:
            problems.append(f"{where}: input {name!r} optional is {bool(tensor.optional)}, {source} says {optional}")
    return problems


_LORA_OUTPUT = {contract.LORA_SWITCH_S.name: (contract.LORA_SWITCH_S.data_type,
                                                              contract.LORA_SWITCH_S.dims, False)}


def _manifest_io(infos, where: str) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    return {t.name: (configs.triton_type(t.dtype, where), tuple(t.shape), False) for t in infos}


def _engine_problems(folder: Path, config: ModelConfig, manifest: Any) -> list[str]:
    where = f"model {folder.name}"
    if manifest is None:
        return [f"{where}: no engine manifest to check its inputs and outputs against"]
    problems = _io_problems(where, "input", config.input, _manifest_io(manifest.inputs, where), "the engine manifest")
    # a LoRA-serving engine model (its loras/ parts) answers LORA_SWITCH_S beside the engine's outputs
    serves_loras = (folder / VERSION / LORA_FOLDER / LORA_INDEX).is_file()
    problems += _io_problems(where, "output", config.output,
                             _manifest_io(manifest.outputs, where) | (_LORA_OUTPUT if serves_loras else {}),
                             "the engine manifest")
    if config.max_batch_size != 0:
        problems.append(f"{where}: max_batch_size is {config.max_batch_size}; engines carry their batch in their "
                        "shapes (0)")
    for file in _required_files(config):
        if not (folder / VERSION / file).is_file():
            problems.append(f"{where}: {VERSION}/{file} is missing")
    inputs = {t.name: t for t in config.input}
    if not config.model_warmup:
        problems.append(f"{where}: model_warmup is empty; the first request at this bucket would pay for warm-up")
    for sample in config.model_warmup:
        for name, data in sample.inputs.items():
            tensor = inputs.get(name)
            if tensor is None:
                problems.append(f"{where}: model_warmup {sample.name!r} feeds {name!r}, which is not an input")
                continue
            if data.data_type != tensor.data_type:
                problems.append(f"{where}: model_warmup {sample.name!r} input {name!r} data_type "
                                f"{configs.type_name(data.data_type)}, the input is "
                                f"{configs.type_name(tensor.data_type)}")
            if len(data.dims) != len(tensor.dims) or any(d >= 0 and d != w for d, w in zip(tensor.dims, data.dims)):
                problems.append(f"{where}: model_warmup {sample.name!r} input {name!r} dims {list(data.dims)} do "
                                f"not fit the input's {list(tensor.dims)}")
        for name in inputs.keys() - sample.inputs.keys():
            problems.append(f"{where}: model_warmup {sample.name!r} does not feed input {name!r}")
    return problems


def _contract_io(decls) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    return {t.name: (t.data_type, tuple(t.dims), t.optional) for t in decls}


def _pipeline_problems(folder: Path, config: ModelConfig, models: dict[str, ModelConfig]) -> list[str]:
    where = f"model {folder.name}"
    version = folder / VERSION
    try:
        description = PipelineDescription.read(version)
    except ServeError as err:
        return [f"{where}: {err}"]
    stage = config.parameters["stage"].string_value if "stage" in config.parameters else ""
    if stage not in contract.STAGES:
        return [f"{where}: parameter stage is {stage!r}, expected one of {contract.STAGES}"]
    inputs, outputs = contract.stage_io(stage, description.family, bool(description.controlnets))
    problems = _io_problems(where, "input", config.input, _contract_io(inputs), f"the {stage} contract")
    problems += _io_problems(where, "output", config.output, _contract_io(outputs), f"the {stage} contract")
    if stage == "full" and config.max_batch_size < 1:  # the entry gathers requests (dynamic batching)
        problems.append(f"{where}: max_batch_size is {config.max_batch_size}, the entry needs at least 1")
    elif stage != "full" and config.max_batch_size != 1:
        problems.append(f"{where}: max_batch_size is {config.max_batch_size}, the contract needs 1")
    for file in ("model.py", f"{SKELETON_DIR}/model_index.json"):
        if not (version / file).is_file():
            problems.append(f"{where}: {VERSION}/{file} is missing")
    for engine in description.engines:
        target = models.get(engine.model)
        source = f"{DESCRIPTION_FILE} of {folder.name}"
        if target is None:
            problems.append(f"{where}: {DESCRIPTION_FILE} routes {engine.component} to model {engine.model!r}, "
                            "which is not in the repository")
            continue
        target_where = f"model {engine.model}"
        problems += _io_problems(target_where, "input", target.input, _manifest_io(engine.inputs, target_where), source)
        problems += _io_problems(target_where, "output", target.output,
                                 _manifest_io(engine.outputs, target_where) | (_LORA_OUTPUT if engine.loras else {}),
                                 source)
        problems += _lora_problems(folder.parent / engine.model / VERSION / LORA_FOLDER / LORA_INDEX, engine.loras,
                                   target_where)
    return problems


def _lora_problems(index: Path, names: tuple[str, ...], where: str) -> list[str]:
    """The LoRAs pipeline.json says an engine model holds must be listed in its loras/loras.json (the files' sha256
    is checked when the model loads)."""
    if not names:
        return []
    try:
        listed = set(json.loads(index.read_text()).get("loras") or {})
    except (OSError, ValueError, AttributeError):
        return [f"{where}: {index.relative_to(index.parents[3])} is missing or unreadable; package again"]
    missing = sorted(set(names) - listed)
    return [f"{where}: LoRA(s) {missing} are not in its {LORA_FOLDER}/{LORA_INDEX}; package again"] if missing else []


def _ensemble_problems(config: ModelConfig, models: dict[str, ModelConfig]) -> list[str]:
    where = f"model {config.name}"
    problems = []
    # tensor name -> (data type, optional): what is available to later steps
    available = {t.name: (t.data_type, bool(t.optional)) for t in config.input}
    for index, step in enumerate(config.ensemble_scheduling.step):
        step_where = f"{where}: step {index} ({step.model_name})"
        model = models.get(step.model_name)
        if model is None:
            problems.append(f"{step_where}: model_name {step.model_name!r} is not in the repository")
            continue
        if model.max_batch_size < config.max_batch_size:
            problems.append(f"{step_where}: max_batch_size {model.max_batch_size} is below the ensemble's "
                            f"{config.max_batch_size}")
        model_inputs = {t.name: t for t in model.input}
        for key, tensor in step.input_map.items():
            if key not in model_inputs:
                problems.append(f"{step_where}: input_map key {key!r} is not an input of {step.model_name}")
            elif tensor not in available:
                problems.append(f"{step_where}: input_map {key!r} <- {tensor!r}, which no ensemble input or "
                                "earlier step provides")
            else:
                data_type, optional = available[tensor]
                if data_type != model_inputs[key].data_type:
                    problems.append(f"{step_where}: input {key!r} is {configs.type_name(model_inputs[key].data_type)}"
                                    f", tensor {tensor!r} is {configs.type_name(data_type)}")
                if optional and not model_inputs[key].optional:
                    problems.append(f"{step_where}: optional tensor {tensor!r} feeds required input {key!r}")
        for name, tensor in model_inputs.items():
            if not tensor.optional and name not in step.input_map:
                problems.append(f"{step_where}: required input {name!r} is not mapped in input_map")
        model_outputs = {t.name: t for t in model.output}
        for key, tensor in step.output_map.items():
            if key not in model_outputs:
                problems.append(f"{step_where}: output_map key {key!r} is not an output of {step.model_name}")
            else:
                available[tensor] = (model_outputs[key].data_type, False)
    for output in config.output:
        if output.name not in available:
            problems.append(f"{where}: output {output.name!r} is produced by no step")
        elif available[output.name][0] != output.data_type:
            problems.append(f"{where}: output {output.name!r} is {configs.type_name(output.data_type)}, its step "
                            f"produces {configs.type_name(available[output.name][0])}")
    return problems
