"""Read engines.yaml into a fully resolved configuration, reporting every problem with file:line."""

from __future__ import annotations

import difflib
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from ..errors import ConfigError
from ..families import (
    QWEN_MAX_TEXT_LENGTH,
    SUBFOLDER,
    WIDE_FLOAT,
    Component,
    EditKind,
    Family,
    family_info,
    family_of_pipeline_class,
    quantized_component,
    quantized_components,
)
from ..step_cache import (
    DEFAULT_BRANCH,
    DEFAULT_INTERVAL,
    DEFAULT_THRESHOLD,
    QUANTIZED_METHODS,
    StepCache,
    StepCacheMethod,
    method_families,
)
from ..workflows import (
    EDIT_PIPELINE_CLASSES,
    FAMILY_WORKFLOWS,
    IMAGE_TO_VIDEO_PIPELINE_CLASSES,
    Workflow,
    edit_pipeline_classes,
    families_that_run,
    workflow_components,
)
from ..workspace.urls import check_workspace_url, local_workspace
from .engine_spec import Bucket, Size
from .preflight import PreflightSettings
from .schema import (
    BUILTIN_DEFAULTS,
    BuildSettings,
    CfgMode,
    EnginesFile,
    FileSource,
    HubSource,
    LoraMode,
    ModelEntry,
    ParityThresholds,
    Precision,
    QuantizationSettings,
    RangeBucket,
    ServingSettings,
    StepCacheSettings,
)
from .yaml_lines import LocatedYaml, load_located_yaml


@dataclass(frozen=True)
class ResolvedSource:
    identity: str  # what keys hash: "local:<path as written>" or "hf:<repo>@<revision>"
    path: Path  # the folder on this machine


@dataclass(frozen=True)
class ResolvedLora:
    name: str
    path: Path
    mode: LoraMode
    scale: float


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    family: Family
    source: ResolvedSource
    components: tuple[Component, ...]
    buckets: tuple[Bucket, ...]
    batch: tuple[int, ...]
    cfg: tuple[CfgMode, ...]
    precision: dict[Component, Precision]
    targets: tuple[str, ...]
    refittable: bool
    controlnets: dict[str, ResolvedSource]
    loras: dict[str, ResolvedLora]
    quantization: QuantizationSettings
    parity: dict[Precision, ParityThresholds]
    workflows: tuple[Workflow, ...] = (Workflow.txt2img,)
    checkpoint: CheckpointKind | None = None  # what the folder's denoiser is for (None: not read)
    text_lengths: tuple[int, int, int] | None = None  # engines.yaml's text_length (min, opt, max); None: the family's
    step_cache: StepCache | None = None  # engines.yaml's step_cache (step_cache.py); None: every step runs in full
    serving: ServingSettings = field(default_factory=ServingSettings)  # engines.yaml's serving: (else defaults')
    # components whose precision engines.yaml left to the family's WIDE_FLOAT default: `precision` holds its fp32,
    # a target that builds bf16 graphs (TensorRT) gets bf16 (`precision_on`)
    wide_float: tuple[Component, ...] = ()
    # components at engines.yaml's file-wide fallback (fp16: neither the file nor the family chose): `precision`
    # holds fp16, a target whose hosts do not all compute fp16 (OpenVINO) gets its own (`precision_on`)
    fallback_float: tuple[Component, ...] = ()

    def precision_of(self, component: Component) -> Precision:
        return self.precision[component]

    def precision_on(self, component: Component, target: str) -> Precision:
        """The component's precision on `target`: `precision`'s, except a WIDE_FLOAT default on a bf16 target and
        the file-wide fallback on a target that computes another one on every host (`fallback_precision`)."""
        if component in self.wide_float and _builds_bf16_graphs(target):
            return WIDE_FLOAT.on_bf16_targets
        if component in self.fallback_float:
            return _fallback_precision(target)
        return self.precision[component]


def _fallback_precision(target: str) -> Precision:
    """What `target` computes under engines.yaml's file-wide fallback on every host it builds on (the registry's
    answer; a target that cannot load gets the fallback itself)."""
    from ..errors import TrtDiffusionError
    from ..target_registry import get_target

    try:
        return Precision(get_target(target).fallback_precision())
    except TrtDiffusionError:
        return BUILTIN_DEFAULTS["precision_fallback"]


def _builds_bf16_graphs(target: str) -> bool:
    """Whether the target exports a bf16 engine from a bf16 graph (computes bf16), as its onnx_precision says: the
    registry's answer, so no target is named here; a target that cannot load gets the portable default."""
    from ..errors import TrtDiffusionError
    from ..target_registry import get_target

    try:
        return get_target(target).onnx_precision(Precision.bf16) == Precision.bf16
    except TrtDiffusionError:
        return False


@dataclass(frozen=True)
class CheckpointKind:
    """What a model folder's checkpoint is for, read from model_index.json and the denoiser's config.json."""

    pipeline_class: str | None
    denoiser_channels: int | None  # the denoiser's input channels
    latent_channels: int | None  # the VAE's
    second_expert: bool = False  # model_index.json names a transformer_2 (Wan 2.2's low-noise expert)
    # model_index.json names an image_encoder (Wan 2.1 I2V's CLIP vision tower) or a processor (Qwen-Image-Edit's)
    image_encoder: bool = False

    @property
    def inpainting(self) -> bool:
        """A denoiser that takes the mask and the masked image's latents beside the noisy latents (9-channel
        SD UNets, 33-channel SD3, FLUX Fill's packed 384)."""
        if self.denoiser_channels is None or self.latent_channels is None:
            return False
        packed = 4 if self.pipeline_class and self.pipeline_class.startswith("Flux") else 1
        return self.denoiser_channels > self.latent_channels * packed

    @property
    def editing(self) -> bool:
        return self.pipeline_class in EDIT_PIPELINE_CLASSES

    @property
    def image_to_video(self) -> bool:
        return self.pipeline_class in IMAGE_TO_VIDEO_PIPELINE_CLASSES

    @property
    def natural_workflows(self) -> tuple[Workflow, ...]:
        """The workflows the checkpoint serves when engines.yaml does not say."""
        if self.image_to_video:
            return (Workflow.img2vid,)
        if self.inpainting:
            return (Workflow.inpaint,)
        return (Workflow.edit,) if self.editing else (Workflow.txt2img,)

    def refusal(self, workflow: Workflow) -> str | None:
        if workflow is Workflow.img2vid and not self.image_to_video:
            return (f"img2vid needs an image-to-video checkpoint ({', '.join(IMAGE_TO_VIDEO_PIPELINE_CLASSES)} in "
                    f"model_index.json; this folder names {self.pipeline_class}, whose transformer takes no image)")
        if self.image_to_video and workflow is not Workflow.img2vid:
            return (f"a {self.pipeline_class} checkpoint's transformer takes the conditioning image's latents "
                    f"({self.denoiser_channels} input channels): it runs img2vid only")
        if self.inpainting and workflow is not Workflow.inpaint:
            return (f"this checkpoint's denoiser takes {self.denoiser_channels} input channels (an inpainting "
                    f"checkpoint): it runs inpaint only")
        if workflow is Workflow.edit and not self.editing:
            return (f"edit needs an editing checkpoint ({', '.join(edit_pipeline_classes(self.pipeline_class))} in "
                    f"model_index.json; "
                    f"this folder names {self.pipeline_class})")
        if self.editing and workflow is not Workflow.edit:
            return f"a {self.pipeline_class} checkpoint is trained to edit: it runs edit only"
        return None


@dataclass(frozen=True)
class EnginesConfig:
    path: Path
    build: BuildSettings
    models: dict[str, ResolvedModel] = field(default_factory=dict)
    preflight: PreflightSettings = field(default_factory=PreflightSettings)

    @property
    def root(self) -> Path:
        return self.path.parent

    @property
    def workspace(self) -> Path:
        """The local folder every stage works in: build.workspace, or the local cache of its URL (workspace/urls.py)."""
        return local_workspace(self.build.workspace, self.build.cache, self.root)

    @property
    def timing_cache_dir(self) -> Path:
        if self.build.timing_cache:
            return (self.root / self.build.timing_cache).resolve()
        return self.workspace / "timing-cache"


class _Problems:
    """Collects every problem of a file so the user sees them all at once."""

    def __init__(self, path: Path, located: LocatedYaml):
        self.path, self.located, self.items = path, located, []

    def add(self, field_path: tuple, message: str) -> None:
        line = self.located.line_of(field_path)
        where = f"{self.path}:{line}" if line else str(self.path)
        dotted = ".".join(str(p) for p in field_path) or "(top level)"
        self.items.append((line or 0, f"{where}: {dotted}: {message}"))

    def raise_if_any(self) -> None:
        if self.items:
            messages = [m for _, m in sorted(self.items, key=lambda x: x[0])]
            header = f"{self.path}: {len(messages)} problem{'s' if len(messages) > 1 else ''}"
            raise ConfigError(header + "\n  " + "\n  ".join(messages), problems=messages)


def load_engines_file(path: str | Path, *, check_sources: bool = True) -> EnginesConfig:
    path = Path(path)
    if path.is_dir():
        inside = path / "engines.yaml"
        hint = f": did you mean {inside}?" if inside.is_file() else " (give the engines.yaml file, not its folder)"
        raise ConfigError(f"{path} is a folder{hint}")
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    located = load_located_yaml(path)
    problems = _Problems(path, located)
    for dup_path, line in located.duplicates:
        problems.add(dup_path, f"duplicate key {dup_path[-1]!r} (also defined above)")
    if not isinstance(located.data, dict):
        problems.add((), "the file must be a mapping with 'version' and 'models'")
        problems.raise_if_any()
    _check_bucket_geometry(located.data, problems)  # on raw data, so it is reported with schema errors
    try:
        parsed = EnginesFile.model_validate(located.data)
    except ValidationError as exc:
        for error in _one_branch_per_value(exc.errors()):
            field_path = _data_path(located.data, error["loc"])
            problems.add(field_path, _friendly(error))
        if check_sources:  # in the same pass: a missing folder or LoRA file is not news after the schema is fixed
            _check_raw_sources(located.data, path.parent, problems)
        problems.raise_if_any()
        raise  # unreachable: a ValidationError always has errors
    url_problem = check_workspace_url(parsed.build.workspace)
    if url_problem:
        problems.add(("build", "workspace"), url_problem)
    models = {}
    for name, entry in parsed.models.items():
        models[name] = _resolve_model(name, entry, parsed, path.parent, problems, check_sources)
    _check_preflight(parsed, models, problems)
    _check_serving(parsed, models, problems)
    problems.raise_if_any()
    return EnginesConfig(path=path.resolve(), build=parsed.build, models=models, preflight=parsed.preflight)


def _check_serving(parsed: EnginesFile, models: dict[str, ResolvedModel], problems: _Problems) -> None:
    """A TensorRT weight budget needs engines built with weight streaming."""
    for name, model in models.items():
        if model.serving.tensorrt_weight_budget_gb is None:
            continue
        own = parsed.models[name].serving is not None
        where = ("models", name, "serving", "tensorrt_weight_budget_gb") if own else (
            "defaults", "serving", "tensorrt_weight_budget_gb")
        if not parsed.build.tensorrt.weight_streaming:
            problems.add(where, "a TensorRT weight budget needs engines built with weight streaming: set "
                                "build: tensorrt: weight_streaming: true (or leave the budget out)")


def _check_preflight(parsed: EnginesFile, models: dict[str, ResolvedModel], problems: _Problems) -> None:
    """The `preflight:` block names a model of this file and one of its targets."""
    settings = parsed.preflight
    if settings.model is not None and settings.model not in models:
        problems.add(("preflight", "model"), f"no model named {settings.model!r} (models: {', '.join(models)})")
        return
    chosen = [models[settings.model]] if settings.model else list(models.values())
    # Only a target the file names is checked: the default (onnxruntime) must not refuse a file whose
    # models build other targets and that never runs preflight.
    if "target" in settings.model_fields_set and len(chosen) == 1 and settings.target not in chosen[0].targets:
        problems.add(("preflight", "target"), f"{chosen[0].name} does not build the {settings.target} target "
                                              f"(targets: {', '.join(chosen[0].targets)})")


def _friendly(error: dict) -> str:
    """pydantic's error in the words of engines.yaml."""
    kind, msg = error["type"], error["msg"]
    if kind == "extra_forbidden":
        key = error["loc"][-1] if error["loc"] else ""
        close = difflib.get_close_matches(str(key), _schema_keys(), n=1, cutoff=0.6)
        return "unknown key" + (f" (did you mean {close[0]!r}?)" if close else "")
    if kind == "enum":
        expected = error.get("ctx", {}).get("expected", "")
        return f"{error.get('input')!r} is not one of {expected}"
    if kind == "missing":
        return "required key is missing"
    if kind == "literal_error" and error["loc"] == ("version",):
        return f"{error.get('input')!r} is not a known format version (this trt-diffusion reads version: 1)"
    if kind in ("model_type", "dict_type", "string_type") and _is_bucket(error["loc"]):
        return (f"a bucket is 'WIDTHxHEIGHT' ('WIDTHxHEIGHTxFRAMES' for video) or {{min, opt, max}}, "
                f"got {error.get('input')!r}")
    if kind == "string_type":
        return f"expected a text value, got {error.get('input')!r}"
    if kind in ("dict_type", "model_type"):
        return f"expected a mapping (key: value), got {error.get('input')!r}"
    if kind == "list_type":
        return f"expected a list, got {error.get('input')!r}"
    if kind in ("int_type", "int_parsing"):
        return f"expected a whole number, got {error.get('input')!r}"
    return msg.removeprefix("Value error, ")


def _is_bucket(loc: tuple) -> bool:
    return "buckets" in loc


def _one_branch_per_value(errors: list[dict]) -> list[dict]:
    """A value that fits no branch of a union (a bucket: a string or a mapping) gets pydantic's complaint from
    every branch; keep the branch the value was written as — a string's errors, or a mapping's."""
    def value_path(error):
        return tuple(p for p in error["loc"] if not _is_branch_tag(p))

    def branch(error):
        tags = [p for p in error["loc"] if _is_branch_tag(p)]
        return tags[0] if tags else None

    kept = []
    by_value: dict[tuple, list[dict]] = {}
    for error in errors:
        by_value.setdefault(value_path(error)[:_union_depth(error)], []).append(error)
    for group in by_value.values():
        branches = {branch(e) for e in group} - {None}
        if len(branches) < 2:
            kept.extend(group)
            continue
        written_as_mapping = any(isinstance(e.get("input"), dict) for e in group if branch(e) is not None
                                 and e["type"] not in ("model_type", "dict_type")) or any(
            e["type"] == "missing" for e in group)
        wrong_shape = ("string_type",) if written_as_mapping else ("model_type", "dict_type")
        kept.extend(e for e in group if e["type"] not in wrong_shape)
    return kept


def _union_depth(error: dict) -> int:
    """How many plain path parts lead to the value a union branch judged (its errors may go deeper)."""
    depth = 0
    for part in error["loc"]:
        if _is_branch_tag(part):
            return depth
        depth += 1
    return depth


def _is_branch_tag(part) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or part.startswith(
        ("function-", "RangeBucket", "HubSource", "FileSource", "constrained-", "list[", "dict[")))


@functools.cache
def _schema_keys() -> tuple[str, ...]:
    """Every key engines.yaml knows, for did-you-mean."""
    from pydantic import BaseModel

    from . import preflight, schema

    keys = set()
    for module in (schema, preflight):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseModel) and value is not BaseModel:
                keys.update(value.model_fields)
    return tuple(sorted(keys))


def _check_raw_sources(data, root: Path, problems: _Problems) -> None:
    """Model folders and LoRA files that do not exist, read from the raw YAML when the schema failed."""
    models = data.get("models") if isinstance(data, dict) else None
    for name, entry in (models or {}).items() if isinstance(models, dict) else ():
        if not isinstance(entry, dict):
            continue
        source = entry.get("source")
        if isinstance(source, str) and not (root / source).is_dir():
            problems.add(("models", name, "source"), f"model folder {source!r} not found (looked in "
                                                     f"{(root / source).resolve()})")
        loras = entry.get("loras")
        for lora_name, lora in loras.items() if isinstance(loras, dict) else ():
            file = lora.get("source") if isinstance(lora, dict) else None
            if isinstance(file, str) and not (root / file).is_file():
                problems.add(("models", name, "loras", lora_name, "source"),
                             f"LoRA file {file!r} not found (looked in {(root / file).resolve()})")


def _check_family_matches_folder(entry: ModelEntry, source: ResolvedSource, where: tuple, problems: _Problems) -> None:
    """`family: sd15` on an SDXL folder builds engines of the wrong shapes: say so from model_index.json."""
    index = source.path / "model_index.json"
    try:
        class_name = json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return  # a missing or unreadable index is reported by the source check
    implied = family_of_pipeline_class(class_name) if isinstance(class_name, str) else None
    if implied is not None and implied is not entry.family:
        problems.add(where, f"the folder's model_index.json names {class_name} (family {implied.value}), not "
                            f"{entry.family.value}: set family: {implied.value}")


def _data_path(data, loc: tuple) -> tuple:
    """Map pydantic's loc (which includes union branch tags) onto the path in the YAML data."""
    path, node = [], data
    for part in loc:
        if part == "[key]":  # the key itself is wrong (a bad name): point at the key's line
            break
        if isinstance(node, dict) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            path.append(part)
            node = node[part]
        elif isinstance(node, (dict, list)) and part not in ("str", "int", "float", "bool") and not str(part).startswith(
            ("function-", "RangeBucket", "HubSource", "FileSource", "constrained-", "list[", "dict[")
        ):
            path.append(part)  # a missing key: point at its parent's line, name the key
            node = None
    return tuple(path)


def _merged(entry: ModelEntry, defaults, name: str):
    value = getattr(entry, name)
    if value is None:
        value = getattr(defaults, name)
    if value is None and name == "cfg" and family_info(entry.family).default_cfg:
        value = [CfgMode(mode) for mode in family_info(entry.family).default_cfg]
    if value is None:
        value = BUILTIN_DEFAULTS.get(name)
    if value is None and name == "targets":
        from ..target_registry import default_target_names

        value = list(default_target_names())
    return value


def _resolve_model(name, entry: ModelEntry, parsed: EnginesFile, root: Path, problems: _Problems, check_sources):
    base = ("models", name)
    info = family_info(entry.family)
    defaults = parsed.defaults

    components = tuple(_merged(entry, defaults, "components") or info.default_components)
    for i, component in enumerate(components):
        if component not in info.components:
            where = base + ("components", i) if entry.components is not None else ("defaults", "components")
            problems.add(where, f"the {entry.family.value} family has no {component.value} "
                                f"(it has: {', '.join(c.value for c in info.components)})")
    if Component.controlnet in components:
        problems.add(base + ("components",), "list ControlNets under 'controlnets:', not in 'components'")

    if entry.controlnets and not info.supports_controlnet:
        problems.add(base + ("controlnets",), f"the {entry.family.value} family has no ControlNet support "
                                              "in trt-diffusion (sd15 and sdxl do)")

    buckets = []
    bucket_field = base + ("buckets",) if entry.buckets is not None else ("defaults", "buckets")
    for i, raw in enumerate(_merged(entry, defaults, "buckets")):
        bucket = _bucket_from_raw(raw)
        if bucket is not None and not _geometry_problems(bucket, info.latent_factor, entry.family):
            if bucket in buckets:
                problems.add(bucket_field + (i,), f"bucket {bucket.label} is listed twice")
            buckets.append(bucket)

    precision = dict(BUILTIN_DEFAULTS["precision"])
    for component in info.components:
        precision.setdefault(component, BUILTIN_DEFAULTS["precision_fallback"])
    chosen_here = {*(defaults.precision or {}), *(entry.precision or {})}
    wide_float = tuple(c for c, p in info.default_precision.items() if p is WIDE_FLOAT and c not in chosen_here)
    precision.update({c: WIDE_FLOAT.elsewhere if p is WIDE_FLOAT else p for c, p in info.default_precision.items()})
    precision.update(defaults.precision or {})
    precision.update(entry.precision or {})
    follower = (Component.controlnet, Component.transformer_2)  # take their precision from another (below)
    fallback_float = {c for c in info.components if c not in follower
                      and c not in BUILTIN_DEFAULTS["precision"] and c not in info.default_precision} - chosen_here
    if Component.controlnet not in chosen_here:
        # A ControlNet follows the denoiser's precision, except fp8/int8: only denoisers are quantized.
        follows = precision[info.denoiser]
        precision[Component.controlnet] = Precision.fp16 if follows.is_quantized else follows
        if follows.is_quantized or info.denoiser in fallback_float:
            fallback_float.add(Component.controlnet)
    if Component.transformer_2 in info.components and Component.transformer_2 not in chosen_here:
        precision[Component.transformer_2] = precision[Component.transformer]  # Wan 2.2's experts: one architecture
        if Component.transformer in fallback_float:
            fallback_float.add(Component.transformer_2)
    for component, chosen in (entry.precision or {}).items():
        if chosen.is_quantized and not quantized_component(entry.family, component):
            takes = " and ".join(c.value for c in quantized_components(entry.family))
            problems.add(base + ("precision", component.value),
                         f"{chosen.value} is for {takes}; the quantize stage does not "
                         f"quantize {component.value} — use fp16, bf16 or fp32")

    loras = {}
    for lora_name, lora in entry.loras.items():
        where = base + ("loras", lora_name)
        lora_path = (root / lora.source)
        if check_sources and not lora_path.is_file():
            problems.add(where + ("source",), f"LoRA file {lora.source!r} not found (looked in {lora_path})")
        loras[lora_name] = ResolvedLora(lora_name, lora_path.resolve(), lora.mode, lora.scale)

    refittable = _merged(entry, defaults, "refittable")
    if any(lora.mode is LoraMode.refit for lora in loras.values()):
        refittable = True
    # fp8/int8 denoisers refit too: the LoRA'd weights with their weight scales recomputed, the calibrated
    # activation scales kept (lora/quantized_refit.py); no recalibration

    if isinstance(entry.source, FileSource):
        source = _resolve_file_source(entry.source, entry.family.value, base + ("source",), root,
                                      local_workspace(parsed.build.workspace, parsed.build.cache, root),
                                      problems, check_sources)
    else:
        source = _resolve_source(entry.source, base + ("source",), root, problems, check_sources, "model_index.json")
        if check_sources:
            _check_family_matches_folder(entry, source, base + ("family",), problems)
    for cn_name, cn in entry.controlnets.items():
        if isinstance(cn.source, FileSource):
            problems.add(base + ("controlnets", cn_name, "source"), "single-file ControlNets are not supported; "
                                                                    "give a diffusers folder")
    controlnets = {
        cn_name: _resolve_source(cn.source, base + ("controlnets", cn_name, "source"), root, problems,
                                 check_sources, "config.json")
        for cn_name, cn in entry.controlnets.items() if not isinstance(cn.source, FileSource)
    }
    checkpoint = _checkpoint_kind(source.path, entry.family) if check_sources and source.path.is_dir() else None
    workflows = _resolve_workflows(entry, defaults, checkpoint, base, problems)
    added = workflow_components(workflows, image_encoder=checkpoint is not None and checkpoint.image_encoder)
    needed = [c for c in added if c not in components]
    if needed and _merged(entry, defaults, "components") is not None:
        where = base + ("components",) if entry.components is not None else ("defaults", "components")
        problems.add(where, f"workflows {', '.join(w.value for w in workflows if w.encodes_image)} encode the "
                            f"init image: add {', '.join(c.value for c in needed)} to components")
    components = components + tuple(needed)
    if checkpoint is not None and checkpoint.pipeline_class is not None:
        components = _with_second_expert(components, checkpoint, _merged(entry, defaults, "components") is not None,
                                         base + ("components",) if entry.components is not None
                                         else ("defaults", "components"), problems)
    cfg = tuple(dict.fromkeys(_merged(entry, defaults, "cfg")))
    if not any(mode.value in info.cfg_kind.serving_cfg for mode in cfg):
        # e.g. `cfg: [batched]` for a true-CFG family: only twice-the-rows denoisers, which its requests never call
        problems.add(base + ("cfg",) if entry.cfg is not None else ("defaults", "cfg"),
                     f"the {entry.family.value} family runs {info.cfg_kind.words}: the engines of cfg "
                     f"{[m.value for m in cfg]} (twice the rows) serve none of its requests; use "
                     f"{list(info.default_cfg)}, its default where cfg is left out")
    parity = dict(defaults.parity or {})
    parity.update(entry.parity or {})
    text_lengths = _resolve_text_length(entry, defaults, base, problems)
    step_cache = _resolve_step_cache(entry, defaults, source.path if check_sources else None, base, problems)
    if info.edit is EditKind.vision_reference and Workflow.edit in workflows:
        _check_edit_buckets(buckets, precision, base, problems)
    if step_cache is not None and precision[info.denoiser].is_quantized and step_cache.method not in QUANTIZED_METHODS:
        # the quantize stage exports the pieces of these methods from the denoiser's calibration (quantize/pieces.py)
        problems.add(base + ("step_cache",) if entry.step_cache is not None else ("defaults", "step_cache"),
                     f"step caching ({step_cache.method.value}) with an {precision[info.denoiser].value} "
                     f"{info.denoiser.value} is not supported yet (the quantize stage has no Q/DQ graphs of its "
                     f"pieces): use fp16, bf16 or fp32, or leave step_cache out")
    return ResolvedModel(
        name=name, family=entry.family, source=source, components=components, buckets=tuple(buckets),
        batch=tuple(sorted(set(_merged(entry, defaults, "batch")))), cfg=cfg,
        precision=precision, targets=tuple(dict.fromkeys(_merged(entry, defaults, "targets"))), refittable=bool(refittable),
        controlnets=controlnets, loras=loras,
        quantization=entry.quantization or defaults.quantization or QuantizationSettings(), parity=parity,
        workflows=workflows, checkpoint=checkpoint, text_lengths=text_lengths, step_cache=step_cache,
        serving=entry.serving or defaults.serving or ServingSettings(), wide_float=wide_float,
        fallback_float=tuple(sorted(fallback_float, key=list(Component).index)),
    )


def _check_edit_buckets(buckets, precision, base: tuple, problems: _Problems) -> None:
    """Qwen-Image-Edit's engines fix the reference image's grid per bucket (about 1024² at the bucket's aspect):
    a range bucket must keep one aspect's grid over its range; and its transformer is not quantized yet."""
    from ..models.edit_reference import condition_size

    for i, bucket in enumerate(buckets):
        sizes = {condition_size(s.width, s.height) for s in (bucket.min, bucket.opt, bucket.max)}
        if len(sizes) > 1:
            shown = ", ".join(f"{w}x{h}" for w, h in sorted(sizes))
            problems.add(base + ("buckets", i), f"edit: bucket {bucket.label} spans reference images of several "
                                                f"resized sizes ({shown}); an edit engine is built for one: use "
                                                f"a bucket of one aspect ratio")
    quantized = [c.value for c, p in precision.items() if p.is_quantized]
    if quantized:
        problems.add(base + ("precision",), f"edit: {', '.join(quantized)} at fp8/int8 is not supported for "
                                            f"Qwen-Image-Edit yet (its calibration has no reference image): use "
                                            f"fp32, fp16 or bf16")


def _resolve_step_cache(entry: ModelEntry, defaults, folder: Path | None, base: tuple,
                        problems: _Problems) -> StepCache | None:
    """engines.yaml's `step_cache`: the method fits the family, each key fits the method, the values are in range
    (a `defaults:` block may serve several families: there, a method that does not fit a model is skipped)."""
    chosen: StepCacheSettings | None = entry.step_cache or defaults.step_cache
    if chosen is None:
        return None
    own = entry.step_cache is not None
    where = base + ("step_cache",) if own else ("defaults", "step_cache")
    method = chosen.method
    if entry.family not in method_families(method):
        if own:
            fits = [m.value for m in StepCacheMethod if entry.family in method_families(m)]
            problems.add(where + ("method",), f"{method.value} is for the {', '.join(f.value for f in method_families(method))} "
                                              f"families, not {entry.family.value}"
                                              + (f" (use {' or '.join(fits)})" if fits else
                                                 f" (no step cache for {entry.family.value} yet)"))
        return None
    deep = method is StepCacheMethod.deepcache
    for key in ("threshold",) if deep else ("interval", "branch"):
        if getattr(chosen, key) is not None:
            problems.add(where + (key,), f"{key} is not a setting of {method.value} "
                                         f"({'interval, branch' if deep else 'threshold'} are)")
    interval = DEFAULT_INTERVAL if chosen.interval is None else chosen.interval
    branch = DEFAULT_BRANCH if chosen.branch is None else chosen.branch
    threshold = DEFAULT_THRESHOLD if chosen.threshold is None else chosen.threshold
    if deep and interval < 2:
        problems.add(where + ("interval",), f"interval {interval} caches nothing: a full UNet step every N steps "
                                            f"needs N >= 2")
    if deep and branch < 0:
        problems.add(where + ("branch",), f"branch {branch} is negative: 0 is the shallowest skip level")
    elif deep and folder is not None and (levels := _unet_branch_levels(folder)) is not None and branch >= levels:
        problems.add(where + ("branch",), f"branch {branch} is past this UNet's {levels} skip levels "
                                          f"(0..{levels - 1})")
    if not deep and not threshold > 0:
        problems.add(where + ("threshold",), f"threshold {threshold:g} must be more than 0 (0 never skips a step)")
    return StepCache(method, interval=interval, branch=branch, threshold=threshold, min_psnr_db=chosen.gate.min_psnr_db,
                     min_ssim=chosen.gate.min_ssim, enabled=chosen.enabled)


def _unet_branch_levels(folder: Path) -> int | None:
    """How many DeepCache branches a UNet has: (layers per block + 1) per block (SD1.5: 4 × 3); None when its
    config cannot be read (the source check reports that)."""
    try:
        config = json.loads((folder / "unet" / "config.json").read_text())
        layers = config["layers_per_block"]
        blocks = len(config["block_out_channels"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(layers, int):  # per-block layer counts: the branch ids DeepCache uses assume one count
        return None
    return blocks * (layers + 1)


def _resolve_text_length(entry: ModelEntry, defaults, base: tuple, problems: _Problems) -> tuple[int, int, int] | None:
    """engines.yaml's `text_length`, for a family whose text length is a profile dimension (Qwen-Image); None where
    it is the family's default (so the engines' keys are those of a file that leaves it out)."""
    chosen = entry.text_length or defaults.text_length
    if chosen is None:
        return None
    where = base + ("text_length",) if entry.text_length is not None else ("defaults", "text_length")
    if family_info(entry.family).text_lengths is None:
        if entry.text_length is not None:  # `defaults` may serve several families: only a model's own is wrong
            problems.add(where, f"the {entry.family.value} family pads every prompt to one length; text_length is "
                                f"for families whose text length is a profile dimension (qwen_image)")
        return None
    lengths = (chosen.min, chosen.opt, chosen.max)
    if not chosen.min <= chosen.opt <= chosen.max:
        problems.add(where, f"needs min <= opt <= max, got {chosen.min}, {chosen.opt}, {chosen.max}")
    elif chosen.max > QWEN_MAX_TEXT_LENGTH:
        problems.add(where + ("max",), f"{chosen.max} is more than QwenImagePipeline's max_sequence_length limit "
                                       f"({QWEN_MAX_TEXT_LENGTH})")
    return None if lengths == family_info(entry.family).text_lengths else lengths


def _with_second_expert(components: tuple[Component, ...], checkpoint: CheckpointKind, declared: bool,
                        where: tuple, problems: _Problems) -> tuple[Component, ...]:
    """A two-expert checkpoint (Wan 2.2) denoises with `transformer` and then `transformer_2`: the pipeline cannot
    run without both, so the default components take the second expert and a `components:` list must name it."""
    expert = Component.transformer_2
    if checkpoint.second_expert and expert not in components:
        if declared:
            problems.add(where, f"this checkpoint has two experts (model_index.json names a {expert.value}, which "
                                f"denoises the low-noise steps): add {expert.value} to components")
        else:
            at = components.index(Component.transformer) + 1 if Component.transformer in components else len(components)
            components = components[:at] + (expert,) + components[at:]
    elif not checkpoint.second_expert and expert in components:
        problems.add(where, f"this checkpoint has no {expert.value} (model_index.json names none: a one-expert "
                            f"model): remove it from components")
    return components


def _resolve_workflows(entry: ModelEntry, defaults, checkpoint: CheckpointKind | None, base: tuple,
                       problems: _Problems) -> tuple[Workflow, ...]:
    declared = entry.workflows if entry.workflows is not None else defaults.workflows
    where = base + ("workflows",) if entry.workflows is not None else ("defaults", "workflows")
    if declared is None:
        return checkpoint.natural_workflows if checkpoint else (Workflow.txt2img,)
    workflows = tuple(dict.fromkeys(declared))
    for i, workflow in enumerate(declared):
        if workflow not in FAMILY_WORKFLOWS[entry.family]:
            problems.add(where + (i,), f"the {entry.family.value} family cannot run {workflow.value} "
                                       f"(families that can: {', '.join(families_that_run(workflow))})")
        elif checkpoint is not None and (why := checkpoint.refusal(workflow)):
            problems.add(where + (i,), f"{workflow.value}: {why}")
    return workflows


def _checkpoint_kind(folder: Path, family: Family) -> CheckpointKind:
    """Read (never trust blindly: a missing or odd file just leaves a field None) what the checkpoint is for."""
    def read(path: Path) -> dict:
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    denoiser = family_info(family).denoiser
    channels = read(folder / SUBFOLDER[denoiser] / "config.json").get("in_channels")
    latent = read(folder / "vae" / "config.json").get("latent_channels")
    index = read(folder / "model_index.json")
    class_name = index.get("_class_name")
    def named(component: Component) -> bool:  # ["diffusers", "WanTransformer3DModel"]; [null, null]: none
        entry = index.get(component.value)
        return isinstance(entry, list) and bool(entry) and entry[0] is not None

    return CheckpointKind(class_name if isinstance(class_name, str) else None,
                          channels if isinstance(channels, int) else None, latent if isinstance(latent, int) else None,
                          second_expert=named(Component.transformer_2),
                          # Qwen-Image-Edit's vision tower is its text encoder's, next to a processor
                          image_encoder=named(Component.image_encoder) or (
                              family_info(family).edit is EditKind.vision_reference and bool(index.get("processor"))))


def _check_bucket_geometry(data: dict, problems: _Problems) -> None:
    """Bucket sides vs each model's latent factor, and min <= opt <= max, for every bucket that parses."""
    models = data.get("models")
    if not isinstance(models, dict):
        return
    defaults = data.get("defaults") if isinstance(data.get("defaults"), dict) else {}
    for name, entry in models.items():
        if not isinstance(entry, dict) or entry.get("family") not in Family._value2member_map_:
            continue
        family = Family(entry["family"])
        field_path = ("models", name, "buckets") if "buckets" in entry else ("defaults", "buckets")
        raw_buckets = entry.get("buckets", defaults.get("buckets", []))
        if not isinstance(raw_buckets, list):
            raw_buckets = [raw_buckets]
        for i, raw in enumerate(raw_buckets):
            bucket = _bucket_from_raw(raw)
            for label, message in _geometry_problems(bucket, family_info(family).latent_factor, family) if bucket else []:
                problems.add(field_path + (i,) + ((label,) if label else ()), message)


def _bucket_from_raw(raw) -> Bucket | None:
    """A bucket from its YAML or schema form; None when malformed (the schema reports that)."""
    try:
        if isinstance(raw, RangeBucket):
            raw = raw.model_dump()
        if isinstance(raw, dict):
            return Bucket(Size.parse(raw["min"]), Size.parse(raw["opt"]), Size.parse(raw["max"]))
        return Bucket.static(Size.parse(raw))
    except (ValueError, KeyError, TypeError):
        return None


def _geometry_problems(bucket: Bucket, factor: int, family: Family) -> list[tuple[str | None, str]]:
    """(sub-field or None, message) for sides off the latent grid and min > opt or opt > max."""
    found = []
    sizes = [("min", bucket.min), ("opt", bucket.opt), ("max", bucket.max)]
    temporal = family_info(family).temporal_factor
    for label, size in sizes[:1] if bucket.is_static else sizes:
        where = None if bucket.is_static else label
        if size.width % factor or size.height % factor:
            found.append((where, f"{size} is not a multiple of {factor} on each side (the {family.value} "
                                 f"family's latent factor)"))
        if size.is_video and not temporal:
            found.append((where, f"{size} has a frame count, but {family.value} is an image family: write "
                                 f"{size.width}x{size.height}"))
        elif temporal and not size.is_video:
            found.append((where, f"{size} has no frame count: {family.value} is a video family, write "
                                 f"WIDTHxHEIGHTxFRAMES (e.g. {size}x81)"))
        elif temporal and (size.frames - 1) % temporal:
            below = (size.frames - 1) // temporal * temporal + 1
            found.append((where, f"{size.frames} frames is not {temporal}k+1 (the {family.value} VAE packs "
                                 f"{temporal} frames per latent frame after the first): use {below} or "
                                 f"{below + temporal}"))
    if not bucket.is_static:
        for (lo_name, lo), (hi_name, hi) in zip(sizes, sizes[1:]):
            if lo.width > hi.width or lo.height > hi.height or lo.frames > hi.frames:
                found.append((lo_name, f"{lo_name} {lo} is larger than {hi_name} {hi}"))
    return found


def _resolve_source(source, where, root: Path, problems: _Problems, check: bool, marker: str) -> ResolvedSource:
    if isinstance(source, HubSource):
        identity = f"hf:{source.repo}@{source.revision}"
        path = Path("<not resolved>")
        if check:
            path = _hub_snapshot(source, where, problems) or path
        return ResolvedSource(identity, path)
    path = (root / source).resolve()
    identity = f"local:{Path(source).as_posix()}"
    if check:
        if not path.is_dir():
            problems.add(where, f"model folder {source!r} not found (looked in {path})")
        elif not (path / marker).is_file():
            problems.add(where, f"{source!r} is not a diffusers folder: {marker} is missing in {path}")
    return ResolvedSource(identity, path)


def _resolve_file_source(source: FileSource, family: str, where, root: Path, workspace: Path, problems: _Problems,
                         check: bool) -> ResolvedSource:
    """A single-file checkpoint: the diffusers folder it is converted to, once, in `<workspace>/checkpoints/`
    (see models/single_file.py; torch and diffusers are imported only when that folder is not current)."""
    import hashlib

    from ..errors import ModelError
    from ..models import single_file

    file = (root / source.file).resolve()
    config = (root / source.config).resolve() if source.config else None
    identity = f"file:{Path(source.file).as_posix()}" + (f"+config:{Path(source.config).as_posix()}" if config else "")
    digest = hashlib.sha256(f"{file}\n{config}".encode()).hexdigest()[:12]
    folder = (workspace / "checkpoints" / f"{file.stem}.{digest}").resolve()
    try:
        if check or file.suffix != ".safetensors":  # a pickled file is refused even when sources are not read
            single_file.check_single_file(file)
        if check:
            if config is not None and not (config / "model_index.json").is_file():
                problems.add(where + ("config",), f"{source.config!r} is not a diffusers folder: model_index.json "
                                                  f"is missing in {config}")
            else:
                config_dir = config or single_file.reference_config_dir(family)
                if not single_file.is_converted(folder, file, config_dir):
                    single_file.convert_single_file(file, folder, family=family, config=config)
    except ModelError as exc:
        problems.add(where + ("file",), str(exc))
    return ResolvedSource(identity, folder)


def _hub_snapshot(source: HubSource, where, problems: _Problems) -> Path | None:
    """Resolve a Hugging Face repo from the local cache only: builds never download implicitly."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(source.repo, revision=source.revision, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        problems.add(where, f"{source.repo}@{source.revision} is not in the local Hugging Face cache; "
                            f"fetch it first: huggingface-cli download {source.repo} --revision {source.revision}")
        return None
