"""Running an openvino engine: one compiled model and one infer request per runner, feeds checked first.

Threads: OpenVINO's LATENCY hint with one stream; INFERENCE_NUM_THREADS from TRT_DIFFUSION_OPENVINO_THREADS,
else from the caller (a Triton instance gets its share of the cores), else every core this process may use.
Compiled models come from the cache folder of this OpenVINO + CPU, so a second load does not recompile.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ...errors import BuildError, RefitError
from ...tensors import TensorSpec
from ..runner_base import BaseRunner
from . import host, precision
from .engine import MANIFEST_FILE, MODEL_FILE, OpenVINOEngineManifest, compile_config, port_named, read_manifest

THREADS_ENV = "TRT_DIFFUSION_OPENVINO_THREADS"


def default_threads() -> int | None:
    value = os.environ.get(THREADS_ENV)
    if not value:
        return None
    try:
        threads = int(value)
    except ValueError:
        raise BuildError(f"{THREADS_ENV}={value!r}: expected a number of threads") from None
    if threads < 1:
        raise BuildError(f"{THREADS_ENV}={value!r}: expected at least 1 thread")
    return threads


def _compute_here(manifest: OpenVINOEngineManifest, facts: host.CpuFacts, folder: Path) -> precision.Compute:
    """The engine's precision on *this* CPU: refused when this CPU cannot compute it (an engine built on
    an AMX host and copied to one without AMX never runs f32 under the bf16 name)."""
    try:
        return precision.resolve(manifest.precision, facts.capabilities, facts.device_name)
    except BuildError as exc:
        raise BuildError(f"{folder} was built on {manifest.cpu}; {exc}") from None


def replace_constants(model, arrays: Mapping[str, np.ndarray], refittable: tuple[str, ...]) -> int:
    """Replace the IR's weight Constants named by ONNX initializer names with `arrays` (same shape and
    dtype). A name the IR folded away (biases, norms) is a RefitError naming it."""
    from openvino import opset13 as ops

    by_name = {}
    for op in model.get_ops():
        if op.get_type_name() == "Constant":
            for name in op.output(0).get_names():
                by_name[name] = op
    problems = []
    for name, array in arrays.items():
        constant = by_name.get(name) if name in refittable else None
        if constant is None:
            problems.append(f"{name}: folded into another constant when OpenVINO converted the ONNX (only conv "
                            "and linear weights stay refittable); use a fused LoRA variant (mode: fused)")
            continue
        shape = tuple(constant.get_output_shape(0))
        if shape != tuple(array.shape):
            problems.append(f"{name}: new value has shape {tuple(array.shape)}, the engine holds {shape}")
            continue
        dtype = constant.get_output_element_type(0).to_dtype()
        replacement = ops.constant(np.ascontiguousarray(array, dtype=dtype))
        replacement.output(0).set_names(constant.output(0).get_names())
        constant.output(0).replace(replacement.output(0))
    if problems:
        shown = "\n  ".join(problems[:10])
        raise RefitError(f"cannot refit {len(problems)} weight(s) of the openvino engine:\n  {shown}")
    return len(arrays)


class OpenVINORunner(BaseRunner):
    """One OpenVINO compiled model on the CPU; `constants` (ONNX initializer name -> array) replace weight
    constants of a refittable engine before compiling (the LoRA refit of this target: the files stay base)."""

    def __init__(self, folder: str | Path, *, name: str | None = None, threads: int | None = None,
                 cache: Path | None = None, constants: Mapping[str, np.ndarray] | None = None):
        ov = host.require_openvino()
        self.folder = Path(folder)
        manifest = read_manifest(self.folder)
        if manifest is None:
            raise BuildError(f"{self.folder} is not a complete openvino engine (no valid {MANIFEST_FILE}); rebuild "
                             "it with `trt-diffusion build engines.yaml --target openvino`")
        self.manifest = manifest
        self.name = name or self.folder.name
        facts = host.cpu_facts()
        compute = _compute_here(manifest, facts, self.folder)
        # Explicit, never OpenVINO's own guess: the same count in process and in a Triton instance gives the
        # same reduction order, so the same numbers.
        self.threads = default_threads() or threads or host.available_cores()
        core = ov.Core()
        model = core.read_model(str(self.folder / MODEL_FILE))
        if constants:
            replace_constants(model, constants, manifest.refit_constants)
        elif cache is not None:
            # A refitted model is compiled without the cache: each LoRA would leave a GB-sized blob behind.
            cache.mkdir(parents=True, exist_ok=True)
            core.set_property({"CACHE_DIR": str(cache)})
        self.compiled = core.compile_model(model, "CPU", compile_config(compute, self.threads))
        self.request = self.compiled.create_infer_request()
        self.inputs = {t.name: TensorSpec(np.dtype(t.dtype), tuple(d if d >= 0 else None for d in t.shape))
                       for t in manifest.inputs}
        self._inputs = {t.name: port_named(self.compiled.inputs, t.name) for t in manifest.inputs}
        self._ports = {t.name: port_named(self.compiled.outputs, t.name) for t in manifest.outputs}
        self.output_names = list(self._ports)
        self._lock = threading.Lock()

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            results = self.request.infer({self._inputs[k]: np.ascontiguousarray(v) for k, v in feeds.items()})
            return {name: np.array(results[port], copy=True) for name, port in self._ports.items()}

    @property
    def runtime_precisions(self) -> dict[str, int]:
        return precision.runtime_precisions(self.compiled)
