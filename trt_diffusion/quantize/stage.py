"""The quantize stage: engines.yaml -> calibrated, gated Q/DQ ONNX denoisers in the artifact store.

Per (model, denoiser, precision, fused-LoRA variant):

    pipeline from the model folder --(LoRA fused)--> ModelOpt PTQ, its statistics taken during the recipe's
          seeded generations; the calibrated state is its own artifact ("calibration"), keyed on what decides
          the scales, so a re-export (other opset, exporter fix) restores it instead of recalibrating
      --> legacy ONNX export with Q/DQ (FP8: trt-domain rewrite, once) --> quality gate vs fp32
      --> "quantized" artifact: model.onnx, modelopt_state.pt, manifest.json   (nothing committed on failure)

Peak memory stays near one copy of the model: the module is freed once traced, the graph is finished with
its weights streamed file to file, and the gate drops its fp32 module before opening the ONNX session.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import progress as live
from ..components import get_component
from ..engines_file import EngineSpec, LoraMode, LoraVariant, Precision, ResolvedModel, expand, load_engines_file
from ..errors import ConfigError, QuantizeError
from ..export.artifact_key import folder_digest
from ..export.modules import fuse_lora
from ..families import Component, family_info, quantized_component
from ..memory import release_memory, return_large_blocks_to_os
from ..models.loading import component_folder, load_component
from ..precision import is_quantized
from ..workspace.files import sha256_file, tool_versions
from ..workspace.store import Artifact, ArtifactStore, hash_inputs
from .calibration import CalibrationRecipe, calibration_loop, capture_calls, denoiser_of, load_pipeline, t5_length
from .defaults import HELD_OUT_SAMPLES
from .exclusions import LayerSelection, effective_patterns, select_layers
from .feeds import DenoiserInterface, denoiser_interface
from .gate import GateThresholds, run_gate
from .onnx_export import ExportSummary, export_opset, finalize_quantized, traced_quantized
from .prompts import load_prompts, take

log = logging.getLogger(__name__)

ARTIFACT_KIND = "quantized"
CALIBRATION_KIND = "calibration"
ONNX_FILE = "model.onnx"
STATE_FILE = "modelopt_state.pt"
EXPORTER = "torch.onnx legacy (dynamo=False)"
# Bump when this stage changes what it writes for the same inputs (wrapper use, rewrite pass, layout).
QUANTIZE_STAGE_VERSION = 1


@dataclass
class QuantizedArtifact:
    model: str
    component: str
    precision: str
    lora: str | None
    path: Path
    manifest: dict
    cached: bool  # an artifact with the same input hash was already committed
    recalibrated: bool  # False when the calibration was restored from its saved state (or cached)

    @property
    def key(self) -> str:
        return self.path.name.rsplit(".", 1)[-1]

    @property
    def onnx_path(self) -> Path:
        return self.path / ONNX_FILE

    @property
    def state_path(self) -> Path:
        return self.path / STATE_FILE

    @property
    def gate(self) -> dict:
        return self.manifest.get("gate", {})

    def to_json(self) -> dict:
        return {"model": self.model, "component": self.component, "precision": self.precision, "lora": self.lora,
                "key": self.key, "path": str(self.path), "cached": self.cached, "recalibrated": self.recalibrated,
                "gate": self.gate, "timings_s": self.manifest.get("timings_s", {})}


@dataclass
class QuantizeReport:
    artifacts: list[QuantizedArtifact] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)  # quantized precisions this stage does not produce yet

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        return {"passed": self.passed, "artifacts": [a.to_json() for a in self.artifacts], "failures": self.failures,
                "unsupported": self.unsupported}


@dataclass(frozen=True)
class _Plan:
    """Everything one quantized variant is made from, and the two input hashes derived from it."""

    model: ResolvedModel
    component: Component
    precision: str
    lora_name: str | None
    loras: tuple[tuple[str, Path, float], ...]
    recipe: CalibrationRecipe
    prompts_source: str
    exclude: tuple[str, ...]
    opset: int
    thresholds: GateThresholds
    calibration_inputs: dict
    artifact_inputs: dict
    piece: str | None = None  # a step cache's piece of the denoiser (quantize/pieces.py), from the same calibration

    @property
    def name(self) -> str:
        return self._named(self.piece or self.component.value)

    @property
    def calibration_name(self) -> str:
        """The calibration's name: the denoiser's, whichever graph (the whole, or a piece) is exported from it."""
        return self._named(self.component.value)

    def _named(self, graph: str) -> str:
        parts = [self.model.name, graph] + ([f"lora-{self.lora_name}"] if self.lora_name else [])
        return ".".join(parts + [self.precision])

    @property
    def calibration_hash(self) -> str:
        return hash_inputs(self.calibration_inputs)

    @property
    def input_hash(self) -> str:
        return hash_inputs(self.artifact_inputs)


def _resolve_loras(model: ResolvedModel, variant: LoraVariant | None) -> tuple[tuple[str, Path, float], ...]:
    if variant is None:
        return ()
    resolved = []
    for lora_name, _identity, scale in variant.sources:
        lora = model.loras.get(lora_name)
        if lora is None:
            raise ConfigError(f"model {model.name!r} has no LoRA {lora_name!r}")
        if lora.mode is not LoraMode.fused:
            raise QuantizeError(f"LoRA {lora_name!r} is mode {lora.mode.value}: quantized engines take fused "
                                "LoRAs only (refit cannot change int8/fp8 weights)")
        resolved.append((lora_name, lora.path, float(scale)))
    return tuple(resolved)


def plan_variant(model: ResolvedModel, component: Component | str, precision: Precision | str,
                 lora_variant: LoraVariant | None = None, *, opset: int = 20, config_root: Path | None = None,
                 size: tuple[int, ...] | None = None, min_output_psnr_db: float | None = None,
                 piece: str | None = None) -> _Plan:
    """Resolve settings, prompts and hashes for one variant (no model is loaded).

    `size`: (width, height), or (width, height, frames) for a video family (default: the first bucket's opt).
    `piece`: one of the model's step-cache pieces (step_cache.PIECES), exported from the denoiser's calibration."""
    component, precision = Component(component), Precision(precision).value
    _check_piece(model, component, piece)
    if not quantized_component(model.family, component):
        denoiser = family_info(model.family).denoiser
        raise QuantizeError(f"{model.name}: quantization of {component.value} is not supported yet "
                            f"(the {model.family.value} denoiser, {denoiser.value}, is)")
    if not is_quantized(precision):
        raise QuantizeError(f"{model.name}.{component.value}: {precision} is not a quantized precision (int8, fp8)")
    settings = model.quantization
    calibration = settings.calibration
    prompts, prompts_source = load_prompts(calibration.prompts, config_root, model.source.path)
    if size is None:
        opt = model.buckets[0].opt
        size = (opt.width, opt.height, opt.frames)
    frames = None
    if family_info(model.family).is_video:  # a video pipeline generates clips: at the bucket's frame count
        frames = int(size[2]) if len(size) > 2 and size[2] else int(model.buckets[0].opt.frames)
    # a UNet whose engines take ControlNet residuals is calibrated with them too (CalibrationRecipe.controlnets)
    controlnet_residuals = bool(component is Component.unet and model.controlnets)
    controlnets = tuple(str(source.path) for source in model.controlnets.values()) if controlnet_residuals else ()
    recipe = CalibrationRecipe(prompts=tuple(take(prompts, calibration.samples)), steps=calibration.steps,
                               seed=calibration.seed, algorithm=calibration.algorithm, width=size[0], height=size[1],
                               max_sequence_length=t5_length(model.source.path, model.family), frames=frames,
                               controlnets=controlnets)
    loras = _resolve_loras(model, lora_variant)
    # a family's own patterns name its denoiser's layers; a text encoder takes the defaults and engines.yaml's
    exclude = effective_patterns(settings.exclude, None if component.is_text_encoder else model.family)
    parity = model.parity.get(Precision(precision))
    thresholds = GateThresholds.for_precision(precision, parity.model_dump() if parity else None, min_output_psnr_db)
    versions = tool_versions("quantize")
    weights, _ = component_folder(model.source.path, component)
    calibration_inputs = {
        "stage": "calibration", "version": QUANTIZE_STAGE_VERSION,
        "source": model.source.identity, "family": model.family.value, "component": component.value,
        "weights": folder_digest(weights), "precision": precision, "exclude": list(exclude),
        "recipe": recipe.digest, "loras": [(name, sha256_file(path), scale) for name, path, scale in loras],
        "modelopt": versions["nvidia-modelopt"], "torch": versions["torch"], "diffusers": versions["diffusers"],
    }
    if controlnets:  # their weights decide the statistics (the recipe names their folders)
        calibration_inputs["controlnets"] = [folder_digest(Path(folder)) for folder in controlnets]
    artifact_inputs = {
        "stage": "quantize", "version": QUANTIZE_STAGE_VERSION, "calibration": hash_inputs(calibration_inputs),
        "opset": export_opset(opset, precision), "exporter": EXPORTER, "onnx": versions["onnx"],
        "controlnet_residuals": controlnet_residuals, "gate": thresholds.to_json(),
    }
    definition = get_component(model.family, component)
    if definition.version > 1:  # its graph (or the trace's rewrites) changed; version-1 kinds keep their keys
        artifact_inputs["declaration"] = {"kind": definition.kind, "version": definition.version}
    if piece is not None:  # only a piece's key sees the cache (where the UNet is cut); the denoiser's does not
        cut = get_component(model.family, component, piece)
        artifact_inputs.update(piece=piece, step_cache=model.step_cache.engine_option(),
                               piece_declaration={"kind": cut.kind, "version": cut.version})
    return _Plan(model, component, precision, lora_variant.name if lora_variant else None, loras, recipe,
                 prompts_source, exclude, export_opset(opset, precision), thresholds, calibration_inputs,
                 artifact_inputs, piece)


def _check_piece(model: ResolvedModel, component: Component, piece: str | None) -> None:
    if piece is None:
        return
    from ..step_cache import PIECES

    if model.step_cache is None or piece not in PIECES[model.step_cache.method]:
        have = PIECES[model.step_cache.method] if model.step_cache else ()
        raise QuantizeError(f"{model.name}: no step-cache piece {piece!r} to quantize (its step cache has "
                            f"{', '.join(have) or 'no pieces: no step_cache'})")
    if component is not family_info(model.family).denoiser:
        raise QuantizeError(f"{model.name}: {piece} is a piece of the {family_info(model.family).denoiser.value}, "
                            f"not of the {component.value}")


def quantize_component(
    model: ResolvedModel, component: Component | str, precision: Precision | str,
    lora_variant: LoraVariant | None, workspace: str | Path, *, opset: int = 20, config_root: Path | None = None,
    size: tuple[int, ...] | None = None, held_out_samples: int = HELD_OUT_SAMPLES, force: bool = False,
    min_output_psnr_db: float | None = None, compare_images: bool = True, piece: str | None = None,
) -> QuantizedArtifact:
    """Calibrate, quantize, export and gate one denoiser variant; commit it to the store at `workspace`.

    Artifacts: `<workspace>/quantized/<model>.<component>[.lora-<name>].<precision>.<key>/` (model.onnx,
    modelopt_state.pt, manifest.json) and the calibration state under `<workspace>/calibration/`.
    `size` (width, height[, frames]) is the calibration size (default: the model's first bucket). Cached when a
    committed artifact has the same input hash; recalibrates only when the calibration inputs changed
    (`force` redoes both). Raises QuantizeError with the measured numbers when the gate fails; nothing is
    committed then. `piece`: a step-cache piece of the denoiser (quantize/pieces.py) instead of the whole: the same
    calibration (restored when committed), its own Q/DQ graph and gate.
    """
    plan = plan_variant(model, component, precision, lora_variant, opset=opset, config_root=config_root, size=size,
                        min_output_psnr_db=min_output_psnr_db, piece=piece)
    store = ArtifactStore(workspace)
    if not force:
        cached = store.lookup(ARTIFACT_KIND, plan.name, plan.input_hash)
        if cached is not None:
            return _result(plan, cached, cached=True, recalibrated=False)

    if plan.component is Component.text_encoder:
        return _quantize_text_encoder(plan, store, held_out_samples)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    interface = denoiser_interface(model, plan.component)  # how a pipeline call maps onto the denoiser's inputs
    graph = denoiser_interface(model, plan.component, plan.piece) if plan.piece else interface  # what is exported
    with _step(plan, 1, "load the pipeline"):
        pipe, denoiser = _load_denoiser(plan)
    selection = select_layers(denoiser, plan.exclude)
    if not selection.quantized:
        raise QuantizeError(f"{plan.name}: the exclusions leave no layer to quantize")
    timings["load_s"] = time.perf_counter() - started

    with _step(plan, 2, "calibration (the recipe's generations, ModelOpt's statistics taken as they run)"):
        pipe, denoiser, calibration, recalibrated, example = _calibrated(
            pipe, denoiser, plan, selection, interface, store, timings, reuse=not force)
    if plan.piece:  # the piece's own inputs (the deep feature, the first block's outputs) from the quantized module
        from .pieces import piece_feeds

        example = piece_feeds(graph, denoiser, example, _siblings(model, plan.component))

    with store.writer(ARTIFACT_KIND, plan.name, plan.input_hash) as writer:
        mark = time.perf_counter()
        with _step(plan, 3, "Q/DQ ONNX export"):
            with traced_quantized(denoiser, graph, example, plan.precision, plan.opset) as traced:
                # The quantized module goes before the graph is read back and before the gate loads a fresh
                # fp32 pipeline: a full-size model is never held twice.
                del pipe, denoiser
                release_memory()
                exported = finalize_quantized(traced, graph, writer.path / ONNX_FILE, plan.precision)
            release_memory()  # the graph skeleton and the exporter's leftovers, before the gate loads
        shutil.copyfile(calibration.file(STATE_FILE), writer.path / STATE_FILE)
        timings["export_s"] = time.perf_counter() - mark

        mark = time.perf_counter()
        with _step(plan, 4, "quality gate (held-out generations, fp32 vs Q/DQ)"):
            pipe, _ = _load_denoiser(plan)
            if plan.piece:  # the piece's Q/DQ graph against the fp32 piece, every output (quantize/pieces.py)
                from .pieces import run_piece_gate

                gate = run_piece_gate(pipe, interface, graph, writer.path / ONNX_FILE, plan.precision, plan.recipe,
                                      plan.thresholds, held_out_samples, _siblings(model, plan.component),
                                      component=plan.component)
            else:
                gate = run_gate(pipe, model.family, interface, writer.path / ONNX_FILE, plan.precision, plan.recipe,
                                plan.thresholds, held_out_samples, compare_images=compare_images,
                                component=plan.component)
            del pipe
        timings["gate_s"] = time.perf_counter() - mark
        if not gate.passed:  # leaving the writer with an exception commits nothing
            raise QuantizeError(f"{plan.name}: quality gate failed, nothing committed\n  "
                                + "\n  ".join(gate.failures) + f"\n  measured: {gate.summary()}")
        timings["total_s"] = time.perf_counter() - started
        writer.manifest.update(_manifest(plan, graph, exported, selection, calibration, gate.to_json(),
                                         recalibrated, timings))
    committed = store.lookup(ARTIFACT_KIND, plan.name, plan.input_hash, verify=False)
    if committed is None:  # just committed: anything else is a bug in the store
        raise RuntimeError(f"{plan.name}: the committed artifact is not found in {store.root}")
    log.info("%s: %s", plan.name, gate.summary())
    return _result(plan, committed, cached=False, recalibrated=recalibrated)


def _siblings(model: ResolvedModel, component: Component):
    """piece name -> its interface (the other pieces of the cache, which compute a piece's extra inputs)."""
    return lambda piece: denoiser_interface(model, component, piece)


def _quantize_text_encoder(plan: _Plan, store: ArtifactStore, held_out_samples: int) -> QuantizedArtifact:
    """A language-model text encoder's variant (quantize/encoder.py): its own four steps, the encoder alone loaded."""
    from . import ptq
    from .encoder import (
        encoder_interface,
        encoder_selection,
        forward_loop,
        gate_states,
        prompt_feeds,
        reference_states,
        run_layers,
        with_negative,
    )
    from .gate import held_out_recipe

    if plan.loras:
        raise QuantizeError(f"{plan.name}: LoRAs change the denoiser only; a text encoder variant takes none")
    family, timings, started = plan.model.family, {}, time.perf_counter()
    return_large_blocks_to_os()  # the trace's fake-quantized weights and the session's temporaries (memory.py)
    interface = encoder_interface(plan.model)
    held_out_prompts, _ = held_out_recipe(plan.recipe, held_out_samples)
    with _step(plan, 1, "load the text encoder; the held-out prompts' fp32 hidden states"):
        module = load_component(plan.model.source.path, Component.text_encoder).eval()
        wrapper = interface.wrapper(module)
        calibration_feeds = prompt_feeds(plan.model, with_negative(family, plan.recipe.prompts))
        held_out = prompt_feeds(plan.model, with_negative(family, held_out_prompts))
        expected = reference_states(wrapper, held_out)
        selection = encoder_selection(module, run_layers(wrapper, module, calibration_feeds[0]), plan.exclude)
    if not selection.quantized:
        raise QuantizeError(f"{plan.name}: the exclusions leave no layer to quantize")
    timings["load_s"] = time.perf_counter() - started

    mark = time.perf_counter()
    with _step(plan, 2, f"calibration ({len(calibration_feeds)} prompts' tokens through the encoder)"):
        ptq.calibrate(module, plan.precision, plan.recipe.algorithm, selection, forward_loop(wrapper, calibration_feeds))
        ptq.check_calibrated(module)
    timings["calibrate_s"] = time.perf_counter() - mark
    with store.writer(CALIBRATION_KIND, plan.calibration_name, plan.calibration_hash) as writer:
        ptq.save_state(module, writer.path / STATE_FILE)
        writer.manifest.update({"inputs": plan.calibration_inputs, "recipe": plan.recipe.to_json(),
                                "prompts_source": plan.prompts_source, "calls": len(calibration_feeds),
                                "precision": plan.precision, "quantizers": len(ptq.enabled_quantizers(module))})
    calibration = store.lookup(CALIBRATION_KIND, plan.calibration_name, plan.calibration_hash, verify=False)

    with store.writer(ARTIFACT_KIND, plan.name, plan.input_hash) as writer:
        mark = time.perf_counter()
        with _step(plan, 3, "Q/DQ ONNX export"):
            # traced at batch 2 (the first prompt twice): a batch-1 trace could fix the batch axis
            example = {name: torch.cat([value, value]) for name, value in calibration_feeds[0].items()}
            with traced_quantized(module, interface, example, plan.precision, plan.opset, stream_weights=True) as traced:
                del module, wrapper  # before the graph is read back and the gate's session opens
                release_memory()
                exported = finalize_quantized(traced, interface, writer.path / ONNX_FILE, plan.precision)
            release_memory()
        shutil.copyfile(calibration.file(STATE_FILE), writer.path / STATE_FILE)
        timings["export_s"] = time.perf_counter() - mark

        mark = time.perf_counter()
        with _step(plan, 4, "quality gate (held-out prompts' hidden states, fp32 vs Q/DQ)"):
            gate = gate_states(writer.path / ONNX_FILE, interface, held_out, expected, plan.precision, plan.thresholds)
        timings["gate_s"] = time.perf_counter() - mark
        if not gate.passed:
            raise QuantizeError(f"{plan.name}: quality gate failed, nothing committed\n  "
                                + "\n  ".join(gate.failures) + f"\n  measured: {gate.summary()}")
        timings["total_s"] = time.perf_counter() - started
        writer.manifest.update(_manifest(plan, interface, exported, selection, calibration, gate.to_json(), True,
                                         timings))
    committed = store.lookup(ARTIFACT_KIND, plan.name, plan.input_hash, verify=False)
    log.info("%s: %s", plan.name, gate.summary())
    return _result(plan, committed, cached=False, recalibrated=True)


def _step(plan: _Plan, position: int, what: str) -> live.Task:
    """Step `position` of the four of one variant (load, calibration, Q/DQ export, gate), as progress lines."""
    return live.task("quantize", subject=plan.name, position=position, total=4, detail=what)


def _load_denoiser(plan: _Plan):
    """The pipeline, and its denoiser (the variant's component) with the variant's LoRAs fused."""
    pipe = load_pipeline(plan.model.source.path)
    denoiser = denoiser_of(pipe, plan.component)
    for name, path, scale in plan.loras:
        fuse_lora(denoiser, name, path, scale, prefix=plan.component.value)
    return pipe, denoiser.eval()


def _calibrated(pipe, denoiser: torch.nn.Module, plan: _Plan, selection: LayerSelection,
                interface: DenoiserInterface, store: ArtifactStore, timings: dict[str, float], reuse: bool = True):
    """Restore the committed calibration when its inputs match; otherwise calibrate and commit it.

    Returns (pipe, quantized denoiser, calibration artifact, recalibrated, example feeds for the export trace).
    """
    from . import ptq

    mark = time.perf_counter()
    saved = store.lookup(CALIBRATION_KIND, plan.calibration_name, plan.calibration_hash) if reuse else None
    if saved is not None:
        try:
            ptq.restore_state(denoiser, saved.file(STATE_FILE))
            ptq.check_calibrated(denoiser)
            # A one-step generation gives the export trace its example inputs, without the whole recipe (Wan 2.2's
            # low-noise expert runs only past the first steps: one prompt at the recipe's steps).
            steps = 1 if plan.component is family_info(plan.model.family).denoiser else plan.recipe.steps
            probe = dataclasses.replace(plan.recipe, prompts=plan.recipe.prompts[:1], steps=steps)
            example = interface.feeds(capture_calls(pipe, plan.model.family, probe, plan.component)[0])
            timings["restore_s"] = time.perf_counter() - mark
            return pipe, denoiser, saved, False, example
        except QuantizeError as exc:
            log.warning("%s: saved calibration unusable (%s); recalibrating", plan.name, exc)
            pipe, denoiser = _load_denoiser(plan)  # the failed restore may have half-converted the module
    forward_loop, recorded = calibration_loop(pipe, plan.model.family, plan.recipe, plan.component)
    ptq.calibrate(denoiser, plan.precision, plan.recipe.algorithm, selection, forward_loop)
    ptq.check_calibrated(denoiser)
    timings["calibrate_s"] = time.perf_counter() - mark  # the generations, with ModelOpt's statistics taken
    with store.writer(CALIBRATION_KIND, plan.calibration_name, plan.calibration_hash) as writer:
        ptq.save_state(denoiser, writer.path / STATE_FILE)
        writer.manifest.update({
            "inputs": plan.calibration_inputs, "recipe": plan.recipe.to_json(), "prompts_source": plan.prompts_source,
            "calls": recorded.seen, "precision": plan.precision,
            "quantizers": len(ptq.enabled_quantizers(denoiser)),
        })
    committed = store.lookup(CALIBRATION_KIND, plan.calibration_name, plan.calibration_hash, verify=False)
    return pipe, denoiser, committed, True, interface.feeds(recorded.calls[0])


def _manifest(plan: _Plan, interface: DenoiserInterface, exported: ExportSummary, selection: LayerSelection,
              calibration: Artifact, gate: dict, recalibrated: bool, timings: dict[str, float]) -> dict:
    return {
        "inputs": plan.artifact_inputs, "calibration_artifact": str(calibration.path),
        "onnx": ONNX_FILE, "state_file": STATE_FILE,
        "group": {"model": plan.model.name, "family": plan.model.family.value, "component": plan.component.value,
                  "lora_variant": plan.lora_name},
        "component_kind": interface.definition.kind, "precision": plan.precision, "opset": plan.opset,
        "io": interface.io.to_json(), "static_shapes": interface.static_shapes,
        "source": plan.model.source.identity,
        "loras": [{"name": n, "file": str(p), "scale": s} for n, p, s in plan.loras],
        "algorithm": plan.recipe.algorithm, "calibration": plan.recipe.to_json(), "prompts_source": plan.prompts_source,
        "exclude_patterns": list(plan.exclude), "quantized_layers": list(selection.quantized),
        "excluded_layers": selection.excluded,
        "graph": exported.to_json(),
        "versions": tool_versions("quantize"), "recalibrated": recalibrated, "gate": gate,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
    }


def _result(plan: _Plan, artifact: Artifact, cached: bool, recalibrated: bool) -> QuantizedArtifact:
    return QuantizedArtifact(plan.model.name, plan.component.value, plan.precision, plan.lora_name, artifact.path,
                             artifact.manifest, cached, recalibrated)


def quantize(config_path: str | Path, model: str | None = None, *, force: bool = False) -> QuantizeReport:
    """Quantize every denoiser variant engines.yaml builds in int8/fp8 (each fused LoRA is its own variant).

    The variants are those of the engine matrix (`engines_file.expand`). Quantized components other than the denoiser
    (a ControlNet inheriting the UNet's precision, an int8 text encoder) are listed in `report.unsupported`.
    Commits every variant that passes, then raises QuantizeError listing all that failed (the error's
    `.report` holds the full QuantizeReport).
    """
    config = load_engines_file(config_path, check_sources=True)
    if model is not None and model not in config.models:
        raise ConfigError(f"{config.path}: no model {model!r} (models: {', '.join(config.models)})")
    variants: dict[tuple, EngineSpec] = {}
    for spec in expand(config):
        if (model is None or spec.model == model) and spec.precision.is_quantized:
            variants.setdefault((spec.model, spec.component, spec.controlnet, spec.precision, spec.lora_variant,
                                 spec.piece), spec)
    report = QuantizeReport()
    for spec in variants.values():
        resolved = config.models[spec.model]
        controlnet = f":{spec.controlnet}" if spec.controlnet else ""
        lora = f".lora-{spec.lora_variant.name}" if spec.lora_variant else ""
        label = f"{spec.model}.{spec.piece or spec.component}{controlnet}{lora}.{spec.precision}"
        if not quantized_component(resolved.family, spec.component):
            report.unsupported.append(f"{label}: only the denoiser (and a language-model text encoder) is quantized "
                                      "by this stage yet")
            continue
        try:
            report.artifacts.append(quantize_component(
                resolved, spec.component, spec.precision, spec.lora_variant, config.workspace,
                opset=config.build.opset, config_root=config.root, force=force, piece=spec.piece))
        except QuantizeError as exc:
            report.failures.append(f"{label}: {exc}")
    if report.failures:
        error = QuantizeError(f"{len(report.failures)} quantized variant(s) failed:\n" + "\n".join(report.failures))
        error.report = report
        raise error
    return report
