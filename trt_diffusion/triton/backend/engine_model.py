"""A python-backend model running one engine through its target's runner (the bundled server has only
the python backend).

The engine files lie in the model's version folder; the config's `target` parameter names the target,
whose `runner_from_files` creates the runner exactly as the in-process pipeline does, so both give the
same numbers.

Engine models can be called directly, not only by the pipeline: every request's shapes are checked against the
engine's profile (`profile_shapes` of the manifest.json packaged beside it) before the runner sees them. Triton
checks the rank and the fixed dims of the config; the dynamic dims of a range bucket (-1 there) only this can
check, and an ONNX Runtime engine would otherwise run any size.

A KIND_GPU instance runs on the GPU Triton gave it (`model_instance_device_id`; an instance group with `gpus: [1]`
puts its instances on GPU 1): its runner binds that device, not device 0 (`instance_device`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import RuntimeInputError
from ...targets.lora_switch import DEFAULT_CAPACITY, LoraParts, LoraSwitchingRunner, parse_set_parameter
from ..contract import LORA_SWITCH_S, LORAS_PARAMETER
from . import pb
from .metrics import Metrics


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from ...targets import get_target

        config = json.loads(args["model_config"])
        self.name = config["name"]
        folder = Path(args["model_repository"]) / args["model_version"]
        target = config["parameters"]["target"]["string_value"]
        device = instance_device(args)
        self.runner = (get_target(target).runner_from_files(folder, self.name) if device is None
                       else get_target(target).runner_from_files(folder, self.name, device=device))
        self.output_names = [output["name"] for output in config["output"]]
        self.profile = read_profile(folder)
        self.runner = _with_loras(self.runner, get_target(target), folder, self.name, config)
        self.metrics = Metrics() if isinstance(self.runner, LoraSwitchingRunner) else None

    def execute(self, requests: list) -> list:
        utils = pb.utils()
        responses = []
        for request in requests:
            try:
                feeds = {name: pb.input_array(request, name) for name in self.runner.inputs}
                check_profile(self.name, self.profile, feeds)
                outputs = {}
                if isinstance(self.runner, LoraSwitchingRunner):  # the set the entry asked for, then the call
                    switch_s = self.runner.select(parse_set_parameter(request_parameter(request, LORAS_PARAMETER)))
                    outputs[LORA_SWITCH_S.name] = np.array([switch_s], np.float32)
                    if self.runner.last_change is not None:
                        self.metrics.add("lora_switches_total", model=self.name, result=self.runner.last_change)
                outputs.update(self.runner.run(feeds))
                responses.append(utils.InferenceResponse(
                    [utils.Tensor(name, outputs[name]) for name in self.output_names]))
            except RuntimeInputError as err:
                responses.append(pb.error_response(str(err)))
            except Exception as err:  # noqa: BLE001 - one bad request must not take the model down
                responses.append(pb.internal_error(self.name, err))  # its kind only, no path
        return responses


def _with_loras(runner: Any, target: Any, folder: Path, name: str, config: dict) -> Any:
    """The runner wrapped to switch LoRA sets per request when the version folder holds LoRA parts."""
    parts = LoraParts.read(folder)
    if parts is None:
        return runner
    capacity = int(config["parameters"].get("lora_cache_sets", {}).get("string_value") or DEFAULT_CAPACITY)
    return LoraSwitchingRunner(runner, parts, lambda weights: target.lora_runner(folder, name, weights, base=runner),
                               capacity=capacity)


def request_parameter(request: Any, key: str) -> Any:
    """One of the request's parameters (a JSON object Triton hands over as a string), None when absent."""
    try:
        return json.loads(request.parameters() or "{}").get(key)
    except (AttributeError, ValueError, TypeError):
        return None


def instance_device(args: Mapping[str, Any]) -> int | None:
    """The GPU a KIND_GPU instance runs on, as the python backend says (`model_instance_kind` GPU,
    `model_instance_device_id` N); None for CPU instances."""
    if str(args.get("model_instance_kind", "")).upper() != "GPU":
        return None
    try:
        return int(args["model_instance_device_id"])
    except (KeyError, TypeError, ValueError):
        raise RuntimeInputError(f"a GPU instance without a usable model_instance_device_id "
                                f"({args.get('model_instance_device_id')!r})") from None


Profile = Mapping[str, Sequence[Sequence[Sequence[int]]]]  # input -> (min, opt, max) shapes


def read_profile(folder: Path) -> Profile:
    """The engine's `profile_shapes` from the manifest.json in its version folder ({} when it has none)."""
    try:
        manifest = json.loads((Path(folder) / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    profile = manifest.get("profile_shapes") if isinstance(manifest, dict) else None
    return profile if isinstance(profile, dict) else {}


def _describe(low: Sequence[int], high: Sequence[int]) -> str:
    return "[" + ", ".join(str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in zip(low, high)) + "]"


def check_profile(model: str, profile: Profile, feeds: Mapping[str, Any]) -> None:
    """Refuse a feed whose shape the engine was not built for: one RuntimeInputError naming each input, dim and
    the range the engine takes there. Absent inputs and ranks are the runner's to report."""
    problems = []
    for name, shapes in profile.items():
        value = feeds.get(name)
        if value is None:
            continue
        low, high = [int(d) for d in shapes[0]], [int(d) for d in shapes[-1]]
        shape = tuple(int(d) for d in value.shape)
        if len(shape) != len(low):
            problems.append(f"input {name} has shape {list(shape)}, the engine takes {_describe(low, high)}")
            continue
        for dim, (size, lo, hi) in enumerate(zip(shape, low, high)):
            if not lo <= size <= hi:
                allowed = str(lo) if lo == hi else f"{lo}..{hi}"
                problems.append(f"input {name} dim {dim} is {size}, the engine takes {allowed} there "
                                f"({name}: {_describe(low, high)})")
    if problems:
        raise RuntimeInputError(f"{model}: {'; '.join(problems)}")
