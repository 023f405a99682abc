"""The TensorRT target class: the `targets.base.Target` hooks over the pure decisions (`build_flags.py`,
`precision.py`, `host_gates.py`, `manifest.py`, ...) and `engine.py` (the only importer of `tensorrt`)."""


from __future__ import annotations

from pathlib import Path

from ...precision import Precision, float_dtype
from ..base import BuildRequest, BuiltEngine, TargetBase, TritonEngineModel

# build.tensorrt settings that become `tensorrt_<name>` build options when not their default
OPTIONAL_SETTINGS = {"allow_refit_on_11_3": False, "version_compatible": False, "strip_plan": False,
                     "weight_streaming": False, "tf32": True}


class TensorRTTarget(TargetBase):
    name = "tensorrt"

    def profiles_layout(self, config) -> bool:
        """`build.tensorrt.engine_layout: profiles`: one engine per weight set, an optimization profile per shape."""
        return config.build.tensorrt.engine_layout == "profiles"

    def layout_memory(self, specs, weight_bytes_per_engine: int) -> dict[str, int]:
        """GPU weights of `engine_layout: per_shape` (a copy per shape) vs `profiles` (a copy per weight set),
        whichever layout `specs` were expanded under (a multi-profile spec counts its shapes)."""
        from .layout import layout_memory

        memory = layout_memory([member for spec in specs for member in spec.members], weight_bytes_per_engine)
        return {"per_shape_engines": memory.engines_per_shape, "per_shape_bytes": memory.per_shape_bytes,
                "profiles_engines": memory.engines_profiles, "profiles_bytes": memory.profiles_bytes}

    def farm_needs(self, spec) -> dict:
        """Ray task options of a build: one GPU, of the spec's architecture when engines.yaml lists them
        (a node offers it as a custom resource: `ray start --resources '{"sm_90": 1}'`)."""
        architecture = spec.option("architecture")
        return {"num_gpus": 1, "resources": {architecture: 1} if architecture else {}}

    def spec_unavailable_reason(self, spec) -> str | None:
        """A plan for another GPU architecture is built on a host that has it (`build --ray`), not here."""
        from .host_probe import host_info
        from .versions import architecture_mismatch

        wanted = spec.option("architecture")
        return architecture_mismatch(wanted, host_info()[1]) if wanted else None

    def build_variants(self, config) -> list[dict]:
        """One engine per GPU architecture engines.yaml lists (plans are specific to one); one otherwise."""
        options = self.build_options(config)
        architectures = config.build.tensorrt.architectures
        return [{**options, "architecture": a} for a in architectures] if architectures else [options]

    def unavailable_reason(self) -> str | None:
        from .host_probe import tensorrt_available

        ok, reason = tensorrt_available()
        return None if ok else reason

    def onnx_precision(self, precision: str) -> str:
        """The ONNX export a `precision` engine is built from (strongly typed: the graph's dtypes are the
        engine's): fp32, fp16 and bf16 graphs (fp32 I/O) for those precisions; fp8/int8 engines are built
        from the quantize stage's Q/DQ graph, converted to Q/DQ over the family's base, fp16 or bf16 (`engine_onnx`, `qdq_fp16.py`)."""
        return precision if float_dtype(precision) else Precision.fp32

    def build_options(self, config) -> dict:
        settings = config.build.tensorrt
        options = {"tensorrt_optimization_level": settings.optimization_level}
        if settings.workspace_gb is not None:  # set explicitly: its engines keep the key they had with it
            options["tensorrt_workspace_gb"] = settings.workspace_gb
        # only where not the default: a default keeps every engine's key as it was
        for name, default in OPTIONAL_SETTINGS.items():
            value = getattr(settings, name, default)
            if value != default:
                options[f"tensorrt_{name}"] = value
        return options

    def build(self, request: BuildRequest) -> tuple[Path, bool]:
        from . import builder as engine
        from .manifest import engine_path

        engine.check_can_build(request.spec)  # the hardware gate, before TensorRT is started
        plan = engine_path(request.workspace, request.spec)
        if self.is_current(request):
            return plan, True
        refit_map = None
        if request.write_refit_map is not None:  # TensorRT refits by ONNX initializer name: keep the map beside the plan
            refit_map = plan.with_name(plan.name.removesuffix(".plan") + ".refit_map.json")
            plan.parent.mkdir(parents=True, exist_ok=True)
            request.write_refit_map(request.onnx_path, refit_map)
        # engine_layout: profiles — every member shape's profile, added to one builder config (tactics per profile)
        engine.build_engine(self.engine_onnx(request), request.spec, request.profile, plan, request.timing_cache_dir,
                            refit_map=str(refit_map) if refit_map else None, extra_profiles=request.extra_profiles,
                            profile_labels=profile_labels(request.spec))
        return plan, False

    def engine_onnx(self, request: BuildRequest) -> Path:
        """The ONNX the engine is built from: the request's, except that an fp8/int8 engine from the quantize
        stage's Q/DQ graph over fp32 is built from its Q/DQ-over-fp16 form (made once, in the workspace)."""
        return _engine_onnx(request.spec, Path(request.onnx_path), Path(request.workspace))

    def is_current(self, request: BuildRequest) -> bool:
        """Reuse a plan only when its manifest records exactly these inputs on this TensorRT and GPU, the plan
        is the one its manifest's sha256 names, and it still holds the weights it was built with (a refitted
        plan is never taken for a build)."""
        from ...onnx_facts import onnx_has_qdq, onnx_sha256
        from .build_flags import BuildFlags
        from .host_probe import host_info
        from .manifest import EngineManifest, engine_path, manifest_is_current, manifest_path
        from .plan_trust import plan_file_problem

        plan = engine_path(request.workspace, request.spec)
        try:
            manifest = EngineManifest.read(manifest_path(plan))
        except Exception:  # noqa: BLE001 - missing or unreadable: build
            return False
        if plan_file_problem(manifest, plan) is not None:  # missing, resized or changed: build
            return False
        trt_version, compute_capability, _ = host_info()
        onnx_path = self.engine_onnx(request)
        flags = BuildFlags.for_spec(request.spec, onnx_has_qdq(onnx_path))
        return manifest_is_current(manifest, request.spec, onnx_sha256(onnx_path), flags, request.profile,
                                   trt_version, compute_capability, extra_profiles=request.extra_profiles)

    def find(self, workspace: Path, spec) -> BuiltEngine | None:
        """The built engine of `spec`: a plan whose sha256 is the one its manifest records (a verdict cached on
        the file's inode, size and mtime). A plan whose refit was interrupted is found (`refit` restores it);
        loading it for inference is refused."""
        from .manifest import EngineManifest, engine_path, manifest_path
        from .plan_trust import plan_file_problem

        plan = engine_path(workspace, spec)
        try:
            manifest = EngineManifest.read(manifest_path(plan))
        except Exception:  # noqa: BLE001 - missing or unreadable manifest: not built
            return None
        if manifest.spec_key != spec.key or plan_file_problem(manifest, plan, for_refit=True) is not None:
            return None
        return BuiltEngine(spec, plan, manifest)

    def runner(self, engine: BuiltEngine, weights=None):
        import functools

        from ...errors import RefitError
        from .plan_load import load_engine
        from .runner import TensorRTRunner

        if weights:
            raise RefitError("LoRA refit at load time is not implemented for the tensorrt target; apply it with "
                             "`trt-diffusion refit --target tensorrt`")
        from .served_memory import serving_weight_budget

        # the spec goes with the load: host code only where the spec asks for version compatibility; the model's
        # serving: tensorrt_weight_budget_gb (weight streaming) where engines.yaml sets one
        return TensorRTRunner(engine.path, name=engine.spec.name, loader=functools.partial(load_engine, spec=engine.spec),
                              weight_budget_bytes=serving_weight_budget(engine.serving))

    def refit(self, engine: BuiltEngine, weights, source_onnx) -> int:
        """Refit the plan from its base ONNX (so no earlier LoRA stays behind), then `weights` over it, and
        save it in place with the manifest recording what it now holds (`refit`: None means base again)."""
        from ...lora import RefitMap, refit_weights_for_tensorrt
        from ...precision import is_quantized
        from . import plan_load
        from . import refit as trt_refit
        from .precision import qdq_base_precision

        onnx_path = source_onnx()
        # the ONNX the plan was built from (for fp8/int8: Q/DQ over its base); the plan is
        # <workspace>/engines/tensorrt/x.plan. Checked against the manifest before it is taken as the base.
        base_onnx = _engine_onnx(engine.spec, Path(onnx_path), Path(engine.path).parents[2])
        check_refit_base(engine.manifest, base_onnx)
        refit_map = RefitMap.load(engine.manifest.refit_map, onnx_path=onnx_path)
        loaded = plan_load.load_engine(engine.path, spec=engine.spec, for_refit=True)
        if is_quantized(engine.spec.precision):  # weights with their recomputed scales, over the Q/DQ base
            arrays = (refit_weights_for_tensorrt(refit_map, weights, precision=qdq_base_precision(engine.spec))
                      if weights else {})
            trt_refit.refit_quantized_from_base(loaded, base_onnx, arrays)
        else:
            arrays = refit_weights_for_tensorrt(refit_map, weights, precision=engine.spec.precision) if weights else {}
            trt_refit.refit_from_base(loaded, onnx_path, arrays)
        # a stripped plan refitted with a LoRA is saved with its weights (else its load restores the base ones)
        plan = trt_refit.serialize_refitted(loaded, with_weights=bool(arrays))
        save_refitted_plan(engine.path, loaded.manifest, plan, arrays)
        return len(arrays)

    def triton_model(self, engine: BuiltEngine, *, engine_backend: str) -> TritonEngineModel:
        from ...errors import BuildError
        from .manifest import PACKAGED_MANIFEST, PACKAGED_PLAN, manifest_path
        from .plan_trust import interrupted_refit_problem, plan_file_problem
        from .served_memory import triton_parameters

        problem = interrupted_refit_problem(engine.manifest) or plan_file_problem(engine.manifest, engine.path,
                                                                                   cached=False)
        if problem:  # packaged files are hashed in full: a repository never carries a plan its manifest disowns
            raise BuildError(problem)
        files = {PACKAGED_PLAN: Path(engine.path), PACKAGED_MANIFEST: manifest_path(engine.path)}
        if engine.manifest.stripped:  # no weights in the plan: the ONNX goes with it
            return self._stripped_triton_model(engine, files, self._budget_parameters(engine))
        # a multi-profile plan (engine_layout: profiles): every profile listed, Triton picks one by the shapes
        profiles = tuple(str(i) for i in range(len(engine.manifest.profiles or ())))
        notes = ["platform tensorrt_plan needs NVIDIA's Triton containers with the TensorRT version and GPU the plans "
                 "were built for"]
        if self._budget_parameters(engine):
            notes.append(f"{engine.spec.name}: serving: tensorrt_weight_budget_gb is not applied by Triton's TensorRT "
                         "backend (it has no weight budget parameter: every weight stays on the GPU); it applies "
                         "where trt-diffusion's runner loads the plan (in-process pipelines, python-backend models)")
        # Triton makes a context per listed profile; ON_PROFILE_CHANGE: each holds its own profile's activations,
        # not the largest over all of them (served_memory.py)
        return TritonEngineModel("tensorrt_plan", "KIND_GPU", files, "model.plan", notes=tuple(notes),
                                 profiles=profiles, parameters=triton_parameters(len(profiles)))

    def activation_memory(self, specs, workspace: Path) -> dict:
        from .served_memory import plan_activations

        return plan_activations(workspace, specs)

    def served_activation_bytes(self, model_folder: Path, backend: str) -> int:
        from .served_memory import packaged_activation_bytes

        return packaged_activation_bytes(model_folder, backend)

    def lora_unservable_reason(self, spec) -> str | None:
        from .lora_serving import lora_unservable_reason

        return lora_unservable_reason({"precision": spec.precision, "refit": spec.refittable}, spec.name)

    def lora_triton_model(self, engine: BuiltEngine, served: TritonEngineModel) -> TritonEngineModel:
        """LoRA per request: a python-backend model running this target's runner, which swaps device-resident weight
        sets per request (lora_serving.py; Triton's TensorRT backend cannot refit), with the refit map beside the
        plan (torch parameter names -> the engine's weight names)."""
        import dataclasses

        from ...errors import BuildError
        from ...lora.refit_map import REFIT_MAP_FILE

        refit_map = Path(engine.manifest.refit_map) if engine.manifest.refit_map else None
        if refit_map is None or not refit_map.is_file():
            raise BuildError(f"cannot serve LoRAs per request with {engine.spec.name}: its refit map "
                             f"{'is not recorded' if refit_map is None else f'{refit_map} is gone'}; rebuild it")
        files = {**served.files, REFIT_MAP_FILE: refit_map}
        note = ("TensorRT engines serving LoRAs per request are python-backend models running trt-diffusion's "
                "TensorRT runner (device-resident LoRA sets swapped by refit_cuda_engine_async on its stream): the "
                "Triton image needs trt-diffusion with its tensorrt extra in the python backend's environment")
        if served.backend == "python":
            return dataclasses.replace(served, files=files, notes=(*served.notes, note))
        return TritonEngineModel("python", "KIND_GPU", files, notes=(note,), parameters=self._budget_parameters(engine))

    @staticmethod
    def _budget_parameters(engine: BuiltEngine) -> dict[str, str]:
        """engines.yaml's serving: tensorrt_weight_budget_gb for the python-backend model's runner (config.pbtxt)."""
        from .served_memory import WEIGHT_BUDGET_PARAMETER, serving_weight_budget

        budget = serving_weight_budget(engine.serving)
        return {} if budget is None else {WEIGHT_BUDGET_PARAMETER: str(budget)}

    def lora_runner(self, folder: Path, name: str, weights, *, base=None):
        """A LoRA set's runner: a view of the instance's base runner that holds the set during its runs
        (lora_serving.py)."""
        from .lora_serving import lora_runner

        return lora_runner(Path(folder), name, weights, base)

    @staticmethod
    def _stripped_triton_model(engine: BuiltEngine, files: dict[str, Path],
                               parameters: dict[str, str]) -> TritonEngineModel:
        """A stripped plan (STRIP_PLAN) is served by a python-backend model running this target's runner, which
        refits every weight from the packaged ONNX at load (Triton's TensorRT backend cannot refit a plan): the
        ONNX the plan was built from, checked against the manifest's sha256, as weights.onnx with its external data."""
        from ...errors import BuildError
        from ...onnx_facts import external_data_files
        from .manifest import PACKAGED_WEIGHTS_ONNX, REBUILD_COMMAND

        manifest = engine.manifest
        source = Path(manifest.onnx_path) if manifest.onnx_path else None
        if source is None or not source.is_file():
            raise BuildError(
                f"cannot package the stripped plan {engine.path}: it refits its weights from the ONNX it was built "
                f"from, and {'its manifest names none' if source is None else f'{source} is gone'}; rebuild with "
                f"`{REBUILD_COMMAND}` (or build with strip_plan: false)")
        check_refit_base(manifest, source)  # the very ONNX the plan was built from, or nothing is packaged
        files = {**files, PACKAGED_WEIGHTS_ONNX: source}
        for location in external_data_files(source):
            if location in files:
                raise BuildError(f"cannot package the stripped plan {engine.path}: its ONNX keeps weights in "
                                 f"{location!r}, a name the model folder already uses")
            files[location] = source.parent / location
        return TritonEngineModel("python", "KIND_GPU", files, notes=(
            "stripped TensorRT plans (strip_plan: true) are served by python-backend models running trt-diffusion's "
            "TensorRT runner, which refits each plan from the weights.onnx beside it when the model loads: the "
            "Triton image needs trt-diffusion with its tensorrt extra (TensorRT and cuda-python) in the python "
            "backend's environment",), parameters={"weights_onnx": PACKAGED_WEIGHTS_ONNX, **parameters})

    def runner_from_files(self, folder: Path, name: str, *, device: int | None = None):
        """The runner of a packaged plan (model.plan, manifest.json); a stripped one refits from the weights.onnx
        packaged beside it when it loads. `device`: the GPU of the Triton instance (`model_instance_device_id`)."""
        import functools

        from .manifest import PACKAGED_PLAN, PACKAGED_WEIGHTS_ONNX, EngineManifest, manifest_path
        from .plan_load import load_engine
        from .runner import TensorRTRunner
        from .served_memory import packaged_weight_budget

        plan = Path(folder) / PACKAGED_PLAN
        stripped = EngineManifest.read(manifest_path(plan)).stripped
        loader = functools.partial(load_engine, device=device or 0,
                                   weights_onnx=Path(folder) / PACKAGED_WEIGHTS_ONNX if stripped else None)
        # engines.yaml's serving: tensorrt_weight_budget_gb, as `package` wrote it in the model's config.pbtxt
        return TensorRTRunner(plan, name=name, loader=loader, device=device,
                              weight_budget_bytes=packaged_weight_budget(Path(folder).parent))


def profile_labels(spec) -> tuple[str, ...] | None:
    """What each optimization profile of a multi-profile spec is for, as the manifest records it
    ("bucket 512x512 × batch 2"); None for a per-shape spec."""
    if not spec.profiles:
        return None
    return tuple(f"{'bucket ' + m.bucket.label + ' × ' if m.bucket else ''}batch {m.batch}" for m in spec.members)


def _engine_onnx(spec, onnx_path: Path, workspace: Path) -> Path:
    from ...onnx_facts import onnx_compute_dtype
    from ...precision import is_quantized
    from .precision import qdq_base_precision

    if is_quantized(spec.precision) and onnx_compute_dtype(onnx_path) == "float32":
        from .qdq_fp16 import qdq_base_onnx

        base = qdq_base_precision(spec)
        return qdq_base_onnx(onnx_path, workspace / "engines" / "tensorrt" / f"qdq-{base}", base)
    return onnx_path


def check_refit_base(manifest, base_onnx: Path) -> None:
    """RefitError unless `base_onnx` is the ONNX the plan was built from (its manifest's `onnx_sha256`): a
    re-export of a changed model would otherwise pass for the base, and a refit from it mixes two models."""
    from ...errors import RefitError
    from ...onnx_facts import onnx_sha256
    from .manifest import REBUILD_COMMAND

    digest = onnx_sha256(base_onnx)
    if digest != manifest.onnx_sha256:
        raise RefitError(
            f"cannot refit engine {manifest.spec_name}: the fresh export {base_onnx} is not the ONNX the plan was "
            f"built from (sha256 {digest[:12]}…, the manifest records {manifest.onnx_sha256[:12]}…): the model or "
            f"the exporter changed since the build; rebuild with `{REBUILD_COMMAND}`")


def save_refitted_plan(plan_path: Path, manifest, plan, weights) -> None:
    """Replace a plan with its refitted form, the manifest saying what it holds at every moment.

    Order: (1) the manifest marks a refit in progress (the plan is no base any more), (2) the plan is
    replaced, (3) the manifest records the weights applied, or `refit: None` when they are the base
    ones. An interruption after (1) or (2) leaves a plan that `build` rebuilds and `refit` restores from
    its ONNX; it never passes for a base engine. `plan` is any buffer (TensorRT's IHostMemory).
    """
    from ...workspace.files import atomic_write_bytes
    from .manifest import RefitRecord, manifest_path
    from .plan_trust import plan_sha256
    from .refit_weights import weights_digest

    nbytes, digest = memoryview(plan).nbytes, plan_sha256(plan)
    record = RefitRecord(weights_sha256=weights_digest(weights), names=tuple(sorted(weights))) if weights else None
    pending = RefitRecord(weights_sha256=record.weights_sha256 if record else "", names=record.names if record else (),
                          in_progress=True, replacing_sha256=manifest.plan_sha256)
    manifest_file = manifest_path(plan_path)
    manifest.model_copy(update={"refit": pending, "plan_bytes": nbytes, "plan_sha256": digest}).write(manifest_file)
    atomic_write_bytes(plan_path, plan)
    manifest.model_copy(update={"refit": record, "plan_bytes": nbytes, "plan_sha256": digest}).write(manifest_file)
