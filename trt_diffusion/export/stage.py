"""Export one group: hash its inputs, reuse a verified artifact or export, clean, check parity, commit.

Memory: the stage never holds two copies of the weights. The fp32 module's reference outputs at every
parity shape are computed first (a few MB), the module is exported (converted in place for fp16) and then
freed, and only then are the graph passes run and the ONNX Runtime parity session opened, against those
stored outputs. Peak RSS is about the larger of "module + exporter" and "ONNX Runtime session".
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .. import progress as live
from ..components import ExportWrapper, get_component, load_model_config
from ..engines_file.load import EnginesConfig
from ..memory import release_memory, return_large_blocks_to_os
from ..precision import Precision
from ..workspace.files import tool_versions
from ..workspace.store import ArtifactStore, hash_inputs
from .artifact_key import describe_inputs
from .graph_passes import finalize_graph
from .grouping import ExportGroup
from .modules import load_group_module, lora_files, weights_folder
from .parity import TOLERANCES, check_parity, reference_outputs
from .results import ExportEvent, ExportResult, ProgressCallback
from .shapes import ExportShapes, export_shapes
from .torch_export import export_module

log = logging.getLogger(__name__)

ARTIFACT_KIND = "onnx"
ONNX_NAME = "model.onnx"
COMPUTE_DTYPES = {Precision.fp32: torch.float32, Precision.fp16: torch.float16, Precision.bf16: torch.bfloat16}


_STAGE_LINES = {
    "hashing": "hashing inputs", "reference": "PyTorch reference outputs", "exporting": "torch.onnx.export",
    "cleaning": "graph passes", "parity": "ONNX Runtime vs PyTorch", "cached": "unchanged (cached)",
}


def export_group(group: ExportGroup, config: EnginesConfig, store: ArtifactStore, *, index: int = 0, total: int = 1,
                 progress: ProgressCallback | None = None) -> ExportResult:
    """Export `group` (or reuse its verified artifact); `progress` gets an ExportEvent per stage, and each
    stage is also logged as a live progress line (`trt_diffusion.progress`)."""
    with live.task("export", total=total, position=index + 1, subject=group.name, done_message=None) as lines:
        def report(stage: str, result: ExportResult | None = None) -> None:
            text = _STAGE_LINES.get(stage, stage)
            lines.step(detail=text if result is None or result.cached else f"{text} ({result.seconds:.1f} s)")
            if progress:
                progress(ExportEvent(group, stage, index, total, result))

        return _export_group(group, config, store, report)


def _export_group(group: ExportGroup, config: EnginesConfig, store: ArtifactStore,
                  report: Callable[..., None]) -> ExportResult:
    started = time.perf_counter()
    model = config.models[group.model]
    definition = get_component(group.family, group.component, group.piece)
    controlnet_dir = model.controlnets[group.controlnet].path if group.controlnet else None
    model_config = load_model_config(model.source.path, group.family, group.component, controlnet_dir)
    shapes = export_shapes(group, definition, model_config)

    report("hashing")
    loras = lora_files(group, model)
    inputs = describe_inputs(group, definition, model_config, shapes, weights_folder(group, model), loras)
    input_hash = hash_inputs(inputs)
    artifact = store.lookup(ARTIFACT_KIND, group.name, input_hash)
    if artifact is not None:
        result = ExportResult(group, artifact, cached=True, seconds=time.perf_counter() - started)
        report("cached", result)
        return result

    with store.writer(ARTIFACT_KIND, group.name, input_hash) as writer:
        timings = {"hash_s": time.perf_counter() - started}
        manifest = _export_into(writer.path, group, definition, model_config, shapes,
                                lambda: load_group_module(group, model), timings, report)
        writer.manifest.update(manifest, inputs=inputs, specs=[s.key for s in group.specs])
    artifact = store.lookup(ARTIFACT_KIND, group.name, input_hash, verify=False)
    if artifact is None:  # just committed: anything else is a bug in the store
        raise RuntimeError(f"{group.name}: the committed export is not found in {store.root}")
    result = ExportResult(group, artifact, cached=False, seconds=time.perf_counter() - started)
    report("done", result)
    return result


def _export_into(folder: Path, group: ExportGroup, definition, model_config, shapes: ExportShapes,
                 load_module: Callable[[], torch.nn.Module], timings: dict, report: Callable[[str], None]) -> dict:
    """Export into `folder`. `load_module` gives the fp32 module; this function holds its only reference,
    so the module is freed before the graph passes and the ONNX Runtime session (see the module docstring)."""
    options = group.options
    io = shapes.graph_io(definition.io(model_config, options))  # a fixed axis (a VAE's frames) as its size
    return_large_blocks_to_os()  # the check session's per-call weight temporaries (memory.py says why)
    label = group.name
    tick = time.perf_counter()
    module = load_module()
    parameter_names = {name for name, _ in module.named_parameters(remove_duplicate=False)}  # tied weights: every name
    timings["load_s"] = time.perf_counter() - tick

    report("reference")
    tick = time.perf_counter()
    expected = reference_outputs(definition.wrapper(module, model_config, options), definition, model_config,
                                 options, shapes.parity)
    timings["reference_s"] = time.perf_counter() - tick

    report("exporting")
    tick = time.perf_counter()
    dtype = COMPUTE_DTYPES[group.precision]
    export_source = module.to(dtype)  # in place: the fp32 weights are not needed any more
    wrapper = definition.wrapper(export_source, model_config, options, compute_dtype=dtype)
    example = definition.dummy_inputs(model_config, options, shapes.example)
    raw_dir = folder / ".raw"
    raw_dir.mkdir()
    with definition.export_context():
        export_module(wrapper, example, io, shapes, group.opset, raw_dir / ONNX_NAME, label,
                      legacy=definition.legacy_trace)
    del wrapper, export_source, module
    release_memory()
    timings["export_s"] = time.perf_counter() - tick

    report("cleaning")
    tick = time.perf_counter()
    summary = finalize_graph(raw_dir / ONNX_NAME, folder / ONNX_NAME, io, parameter_names,
                             ExportWrapper.PARAMETER_PREFIX, label)
    shutil.rmtree(raw_dir)
    # The passes' graph (onnx protos, onnx-graphsurgeon's node cycles) is garbage now; collected before the check
    # session loads the weights, not after (the mid-size FLUX.2 encoder: export peak 1.57 -> 1.42 GB)
    release_memory()
    timings["passes_s"] = time.perf_counter() - tick

    report("parity")
    tick = time.perf_counter()
    checks = check_parity(folder / ONNX_NAME, expected, definition, model_config, options, shapes.parity,
                          group.precision, label)
    timings["parity_s"] = time.perf_counter() - tick
    return {
        "onnx": ONNX_NAME,
        "external_data": ONNX_NAME + ".data",
        "group": {"key": group.key, "model": group.model, "family": group.family, "component": group.component,
                  "controlnet": group.controlnet,
                  "lora_variant": group.lora_variant.name if group.lora_variant else None},
        "component_kind": definition.kind,
        "precision": group.precision,
        "opset": group.opset,
        "io": io.to_json(),
        "dynamic_ranges": {name: list(r) for name, r in shapes.dim_ranges(io).items()},
        "shapes": shapes.to_json(),
        "graph": summary.to_json(),
        "parity": {"tolerance": TOLERANCES[group.precision].__dict__,
                   "reference": "PyTorch fp32 module, same seeded inputs",
                   "checks": [c.to_json() for c in checks]},
        "timings": {k: round(v, 3) for k, v in timings.items()},
        "tools": tool_versions("export"),
    }
