"""The engine manifest: what a .plan was built from and for, where both live, and when an existing plan is
exactly the one a build would make (the only reason a build is skipped)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...engines_file.engine_spec import EngineSpec
from ...errors import BuildError
from ...onnx_facts import ProfileShapes, Shape, validate_profile
from ...tensors import TensorSpec
from ...workspace.files import atomic_write_bytes
from .versions import parse_trt_version

if TYPE_CHECKING:
    from .build_flags import BuildFlags

TARGET = "tensorrt"
MANIFEST_SCHEMA_VERSION = 3  # 2: `refit` records what a refit wrote into the plan; 3: `plan_sha256`
REBUILD_COMMAND = "trt-diffusion build engines.yaml --target tensorrt"


def engine_path(workspace: str | Path, spec: EngineSpec) -> Path:
    """<workspace>/engines/tensorrt/<spec.name>.<spec.key>.plan (the key keeps same-named specs apart)."""
    return Path(workspace) / "engines" / TARGET / f"{spec.name}.{spec.key}.plan"


# A Triton model version folder holds a plan as model.plan and its manifest as manifest.json (`package`); in the
# workspace a plan is <name>.<key>.plan beside <name>.<key>.manifest.json, so the two never meet.
PACKAGED_PLAN, PACKAGED_MANIFEST = "model.plan", "manifest.json"
# the ONNX a stripped plan (STRIP_PLAN) refits its weights from, packaged beside it (with its external data)
PACKAGED_WEIGHTS_ONNX = "weights.onnx"


def manifest_path(plan_path: str | Path) -> Path:
    plan_path = Path(plan_path)
    if plan_path.name == PACKAGED_PLAN:
        return plan_path.with_name(PACKAGED_MANIFEST)
    stem = plan_path.name[: -len(".plan")] if plan_path.name.endswith(".plan") else plan_path.name
    return plan_path.with_name(f"{stem}.manifest.json")


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class RefitRecord(BaseModel):
    """What `trt-diffusion refit` wrote into a plan saved in place: the plan no longer holds its base weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weights_sha256: str  # `weights_digest` of the weights given, by ONNX initializer name
    names: tuple[str, ...]  # the ONNX initializer names that differ from the base ONNX
    # True while a refit is being saved: written before the plan is replaced, so a refit interrupted between
    # the two files leaves a plan that is never taken for its base (the next refit restores it from the ONNX)
    in_progress: bool = False
    # while in progress: the sha256 of the plan being replaced (the file on disk is that one or the new one)
    replacing_sha256: str | None = None
    refitted_at: str = Field(default_factory=lambda: _utc_now())


class EngineManifest(BaseModel):
    """What a .plan was built from and for; read before the plan is ever deserialized."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = MANIFEST_SCHEMA_VERSION
    spec_key: str
    spec_name: str
    target: str = TARGET
    tensorrt_version: str
    compute_capability: tuple[int, int]
    device_name: str
    flags: dict[str, Any]
    profile_shapes: dict[str, tuple[Shape, Shape, Shape]]
    # engine_layout: profiles — the optimization profiles in TensorRT's order (profile_shapes is then their
    # envelope, layout.profile_envelope); None: one profile, profile_shapes
    profiles: tuple[dict[str, tuple[Shape, Shape, Shape]], ...] | None = None
    # what each of `profiles` is for, as the spec says ("bucket 512x512 × batch 2"), in the same order
    profile_labels: tuple[str, ...] | None = None
    onnx_sha256: str
    # the ONNX file the plan was built from (onnx_sha256 is its digest): a stripped plan refits every weight from
    # it at load, and `package` ships it beside such a plan; None in manifests written before it was recorded
    onnx_path: str | None = None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    refit_map: str | None = None
    # None: the plan holds the weights it was built with (the base). Set by `refit`, cleared by a restore.
    refit: RefitRecord | None = None
    plan_bytes: int
    # sha256 of the plan this manifest describes: checked before TensorRT deserializes it (plan_trust.py);
    # None only in manifests made in code, which nothing loads
    plan_sha256: str | None = None
    # `device_memory_size_v2` of the engine: its activation memory, the largest over all its optimization profiles
    # (NvInferRuntime.h; `get_device_memory_size_for_profile_v2` gives each one's): the runner budgets the shared
    # activation allocation with it before loading; None when the build could not read it back
    device_memory_bytes: int | None = None
    # a multi-profile engine's activation memory per profile (`get_device_memory_size_for_profile_v2`): what a
    # context fixed to one profile holds under Triton's ON_PROFILE_CHANGE strategy (served_memory.py)
    profile_device_memory_bytes: tuple[int, ...] | None = None
    # the weights the engine holds on the GPU once loaded: TensorRT's TOTAL_WEIGHTS_SIZE (11.x) or, for a stripped
    # plan (whose file holds none), the ONNX's weight bytes; None when unknown (the plan's size stands for them)
    weights_bytes: int | None = None
    # `streamable_weights_size` of an engine built with weight streaming (None otherwise or unread)
    streamable_weights_bytes: int | None = None
    build_seconds: float
    created_at: str = Field(default_factory=_utc_now)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "engine manifest") -> EngineManifest:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise BuildError(f"{source} is not valid JSON ({err}): rebuild with `{REBUILD_COMMAND}`") from err
        version = raw.get("schema_version") if isinstance(raw, dict) else None
        if version != MANIFEST_SCHEMA_VERSION:
            raise BuildError(
                f"{source} has schema_version {version!r}; this trt-diffusion reads {MANIFEST_SCHEMA_VERSION}: "
                f"rebuild with `{REBUILD_COMMAND}`"
            )
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            raise BuildError(f"{source} is malformed: {err}") from err

    def write(self, path: str | Path) -> None:
        atomic_write_bytes(path, self.to_json().encode())

    @classmethod
    def read(cls, path: str | Path) -> EngineManifest:
        path = Path(path)
        if not path.is_file():
            raise BuildError(f"engine manifest {path} is missing: rebuild with `{REBUILD_COMMAND}`")
        return cls.from_json(path.read_text(), source=f"engine manifest {path}")

    @property
    def is_base(self) -> bool:
        """True when the plan holds its base weights; a refitted plan never passes for a built one."""
        return self.refit is None

    @property
    def stripped(self) -> bool:
        """True when the plan on disk holds no weights (STRIP_PLAN) and takes them from its ONNX at load. A
        stripped build whose LoRA refit completed was saved with its weights (engine.serialize_refitted): loading
        it from the ONNX would put the base weights back over the LoRA."""
        if not self.flags.get("strip_plan"):
            return False
        return self.refit is None or self.refit.in_progress or not self.refit.names

    @property
    def device_weights_bytes(self) -> int:
        """The GPU memory its weights take once loaded: a stripped plan's file size is not that (it holds none)."""
        if self.stripped and self.weights_bytes is not None:
            return max(self.weights_bytes, self.plan_bytes)
        return self.plan_bytes

    def input(self, name: str) -> TensorSpec | None:
        return next((info for info in self.inputs if info.name == name), None)


def manifest_is_current(
    manifest: EngineManifest,
    spec: EngineSpec,
    onnx_digest: str,
    flags: BuildFlags,
    profile_shapes: ProfileShapes,
    trt_version: str,
    compute_capability: tuple[int, int],
    extra_profiles: tuple[ProfileShapes, ...] = (),
) -> bool:
    """True when an existing engine was built from exactly these inputs on this kind of host:
    the only reason a build may be skipped. `extra_profiles`: a multi-profile engine's further profiles (the
    manifest then records every profile, and their envelope as `profile_shapes`)."""
    from .layout import profile_envelope

    profiles = [validate_profile(shapes) for shapes in (profile_shapes, *extra_profiles)]
    envelope = profile_envelope(profiles) if len(profiles) > 1 else profiles[0]
    return (
        manifest.is_base  # a LoRA refitted into the plan is not the engine `build` would make
        and manifest.spec_key == spec.key
        and manifest.onnx_sha256 == onnx_digest
        and manifest.flags == flags.to_dict()
        and manifest.profile_shapes == envelope
        and (manifest.profiles or None) == (tuple(profiles) if len(profiles) > 1 else None)
        and parse_trt_version(manifest.tensorrt_version) == parse_trt_version(trt_version)
        and tuple(manifest.compute_capability) == tuple(compute_capability)
    )
