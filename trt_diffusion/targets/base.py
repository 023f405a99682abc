"""The Target protocol: what every backend (tensorrt, onnxruntime, ...) answers, and the records it returns.

Stages, the runtime and triton/ hold a `Target` from the registry (`targets.get_target(name)`) and call
these methods; none of them compares a target's name. A target module imports its runtime only inside
these methods, so knowing a target costs nothing until it is used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..engines_file import EnginesConfig, EngineSpec
    from ..onnx_facts import ProfileShapes

# (ONNX whose initializers the engine holds, file or folder to write to): saves where each denoiser
# parameter lives among that ONNX's initializers. A target calls it before its manifest seals the engine.
RefitMapWriter = Callable[[Path, Path], None]


@dataclass(frozen=True)
class BuildRequest:
    """Everything one engine is built from."""

    spec: EngineSpec
    onnx_path: Path  # the exported ONNX (the Q/DQ ONNX for fp8/int8 specs)
    profile: ProfileShapes  # input -> (min, opt, max), from the component declaration
    workspace: Path
    timing_cache_dir: Path
    write_refit_map: RefitMapWriter | None = None  # set for refittable specs
    # a spec with several profiles (`EngineSpec.profiles`): the profiles after `profile`, one per further member
    extra_profiles: tuple[ProfileShapes, ...] = ()


@dataclass(frozen=True)
class BuiltEngine:
    """A built engine found in the workspace, trusted through its manifest."""

    spec: EngineSpec
    path: Path  # what the target stores: a folder or a single file
    manifest: Any  # the target's own manifest model
    # engines.yaml's `serving:` of its model (ServingSettings) when found through the config (runtime.loader); how it
    # is run, not built: a TensorRT weight budget
    serving: Any = None


@dataclass(frozen=True)
class TritonEngineModel:
    """How a target serves one engine in a Triton model repository."""

    backend: str  # a Triton backend ("python", "onnxruntime", "openvino") or "tensorrt_plan" (a platform)
    instance_kind: str  # KIND_CPU | KIND_GPU
    files: Mapping[str, Path]  # file name in the model version folder -> source file
    model_file: str | None = None  # the file a non-python backend loads (its default_model_filename)
    notes: tuple[str, ...] = ()  # what the user must know (e.g. which Triton build has this backend)
    parameters: Mapping[str, str] = field(default_factory=dict)  # the backend's config.pbtxt parameters
    # the optimization profiles the instances run in, as Triton names them ("0", "1", ...): a multi-profile
    # TensorRT plan (engine_layout: profiles) lists every one, else Triton's TensorRT backend uses profile 0 only
    profiles: tuple[str, ...] = ()


@runtime_checkable
class Target(Protocol):
    """One backend. Methods take the engine records above; none needs its runtime until it is called."""

    name: str

    def unavailable_reason(self) -> str | None:
        """None when this host can build and run the target, else why not (checked without building)."""

    def build_options(self, config: EnginesConfig) -> dict[str, Any]:
        """engines.yaml build settings that change this target's engines (they enter every spec's key)."""

    def build(self, request: BuildRequest) -> tuple[Path, bool]:
        """Build (or reuse) the engine of `request.spec`: (path, cached). Atomic: an interrupted build
        leaves nothing `find` trusts."""

    def is_current(self, request: BuildRequest) -> bool:
        """True when the engine in the workspace was built from exactly these inputs on this host."""

    def find(self, workspace: Path, spec: EngineSpec) -> BuiltEngine | None:
        """The built engine of `spec`, when its manifest names this spec; None otherwise."""

    def runner(self, engine: BuiltEngine, weights: Mapping[str, Any] | None = None) -> Any:
        """A Runner over the engine. `weights` (torch parameter name -> tensor) are the fused LoRA weights
        of a refittable engine, applied from the base weights (no residue of an earlier LoRA)."""

    def refit(self, engine: BuiltEngine, weights: Mapping[str, Any] | None, source_onnx: Callable[[], Path]) -> int:
        """Apply `weights` (None: restore the base) to the engine; the number of weights replaced.
        `source_onnx()` gives the ONNX the engine was built from (exported on demand)."""

    def triton_model(self, engine: BuiltEngine, *, engine_backend: str) -> TritonEngineModel:
        """The Triton model that serves this engine; `engine_backend` is "python" (a python-backend model
        running this target's runner) or "native" (the target's own Triton backend)."""

    def runner_from_files(self, folder: Path, name: str, *, device: int | None = None) -> Any:
        """A Runner over the files `triton_model` put in a Triton model version folder (python backend). `device`:
        the GPU of a KIND_GPU instance (the python backend's `model_instance_device_id`), passed only for those."""


class TargetBase:
    """The base every target subclasses: the optional hooks the stages call, with their defaults. A target
    overrides the ones it needs (TensorRT: variants per GPU architecture, farm resources, an fp16 ONNX for
    bf16; OpenVINO: what this CPU computes); callers never probe with getattr."""

    name: str

    def build_variants(self, config: EnginesConfig) -> list[dict[str, Any]]:
        """Each variant's key-affecting options: one engine per spec by default (TensorRT: one per GPU)."""
        return [self.build_options(config)]

    def spec_unavailable_reason(self, spec: EngineSpec) -> str | None:
        """Why this host cannot build this one spec (a plan for another GPU architecture); None: it can."""
        return None

    def onnx_precision(self, precision: str) -> str | None:
        """The ONNX precision this target builds `precision` from; None: the exporter's default."""
        return None

    def fallback_precision(self) -> str:
        """What a component gets where neither engines.yaml nor its family chooses a precision (the file-wide
        fallback, fp16): a precision this target computes on every host it builds on."""
        from ..precision import Precision

        return Precision.fp16

    def farm_needs(self, spec: EngineSpec) -> dict[str, Any]:
        """Ray resources a build of `spec` needs on a farm (a GPU of its architecture); none by default."""
        return {}

    def profiles_layout(self, config: EnginesConfig) -> bool:
        """True when this target builds the bucket × batch shapes of one weight set as the optimization profiles of
        one engine (TensorRT's `engine_layout: profiles`): the spec expansion then merges them. False by default."""
        return False

    def layout_memory(self, specs: list[EngineSpec], weight_bytes_per_engine: int) -> dict[str, int] | None:
        """Device weight memory of these specs' engines under each engine layout the target offers (TensorRT:
        one engine per shape, or one engine with a profile per shape); None where there is one layout."""
        return None

    def plan_note(self, precision: str) -> str:
        """What `plan` adds about how this target computes `precision` here and elsewhere; nothing by default."""
        return ""

    def lora_runner(self, folder: Path, name: str, weights: Mapping[str, Any], *, base: Any = None) -> Any:
        """A runner over the engine files of a Triton model version folder (as `runner_from_files` reads them) with
        `weights` (torch parameter name -> fused value) in place of the base ones: the hot refit of LoRA per
        request (targets/lora_switch.py). `base`: the instance's base runner (its threads, cache, device).
        Targets that cannot refit at serve time say so here, and `package` refuses LoRAs for them."""
        raise NotImplementedError(f"the {self.name} target cannot switch LoRAs per request")

    def activation_memory(self, specs: list[EngineSpec], workspace: Path) -> dict[str, int | None] | None:
        """What `plan` shows of these specs' activation memory once served (TensorRT: contexts per instance, and
        bytes once built); None where the target reports none."""
        return None

    def served_activation_bytes(self, model_folder: Path, backend: str) -> int:
        """Activation memory one instance of a packaged engine model holds (TensorRT: from its manifest and the
        allocation strategy of its config.pbtxt), for the served-memory estimate; 0 where unknown."""
        return 0

    def lora_unservable_reason(self, spec: EngineSpec) -> str | None:
        """Why this refittable engine cannot switch LoRAs per request although the target can (TensorRT: an fp8/int8
        engine, whose LoRA needs recomputed weight scales); None: it can."""
        return None

    def lora_triton_model(self, engine: BuiltEngine, served: TritonEngineModel) -> TritonEngineModel:
        """How the engine is served when it switches LoRAs per request: `served` (what `triton_model` gave) by
        default; TensorRT serves it with the python backend (Triton's TensorRT backend cannot refit) and adds its
        refit map."""
        return served
