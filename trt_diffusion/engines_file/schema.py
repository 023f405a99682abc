"""The engines.yaml schema (pydantic, unknown keys rejected).

Field-level rules live here; rules that need several fields (bucket sides vs the family's latent
factor, sources, LoRAs, the preflight block) live in `load.py`, which reads the file and resolves it.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from ..families import Component, Family
from ..precision import Precision
from ..step_cache import StepCacheMethod
from ..workflows import Workflow
from .engine_spec import Size
from .preflight import PreflightSettings


def _known_target(value: str) -> str:
    # The registry knows the targets by name without importing them (target_registry.py).
    from ..target_registry import target_names

    if value not in target_names():
        raise ValueError(f"unknown target {value!r}; known targets: {', '.join(target_names())}")
    return value


# A registered target's name (the registry, not this schema, decides which exist).
Target = Annotated[str, AfterValidator(_known_target)]


class CfgMode(str, Enum):
    batched = "batched"  # conditional + unconditional in one call: the denoiser batch is doubled
    split = "split"  # two calls of the prompt batch per step
    # split's two calls issued at once, on two instances of the denoiser (two sessions in process; two Triton
    # instances, one per GPU where several are given): split's engines, none of its own. Chosen only when declared.
    parallel = "parallel"
    none = "none"  # no classifier-free guidance (guidance-distilled models)


class LoraMode(str, Enum):
    refit = "refit"  # applied to a refittable fp16/bf16/fp32 engine at run time, no rebuild
    fused = "fused"  # merged before export/calibration: its own engines (required for fp8/int8)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HubSource(Strict):
    repo: str
    revision: str = Field(description="a commit sha or tag; pinned so builds are reproducible")


class FileSource(Strict):
    file: str = Field(description="a single-file checkpoint (.safetensors, original A1111/ComfyUI layout)")
    config: str | None = Field(None, description="a diffusers folder whose configs and tokenizers to use; "
                                                 "default: the family's reference configs shipped with the package")


Source = str | HubSource | FileSource


class RangeBucket(Strict):
    min: str
    opt: str
    max: str

    @field_validator("min", "opt", "max")
    @classmethod
    def _size(cls, value: str) -> str:
        Size.parse(value)
        return value


def _static_bucket(value: str) -> str:
    Size.parse(value)
    return value


BucketEntry = Annotated[str, AfterValidator(_static_bucket), Field(description="WIDTHxHEIGHT, or WIDTHxHEIGHTxFRAMES for video")] | RangeBucket


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _safe_name(value: str) -> str:
    # Names become file and folder names (engines, ONNX, Triton models): one plain path component, never a path.
    if not _NAME.fullmatch(value):
        raise ValueError(f"name {value!r} is not allowed: use 1-64 letters, digits, '_', '-' or '.', starting with "
                         "a letter or digit (names become file names)")
    return value


# A model, ControlNet or LoRA name (a key of engines.yaml).
Name = Annotated[str, AfterValidator(_safe_name)]


class TextLength(Strict):
    """Prompt tokens the engines of a family with a dynamic text length take (Qwen-Image): the text axis's profile,
    after the prompt template's fixed prefix. Default: the family's (families.py)."""

    min: int = Field(ge=2, description="torch.export specializes sizes 0 and 1")
    opt: int = Field(ge=2)
    max: int = Field(ge=2)


class ControlNetEntry(Strict):
    source: Source


class LoraEntry(Strict):
    source: str
    mode: LoraMode = LoraMode.refit
    scale: float = 1.0


class CalibrationSettings(Strict):
    prompts: str | None = Field(None, description="a text file, one prompt a line; default: the bundled set")
    samples: int = Field(8, ge=1)
    steps: int = Field(4, ge=1)
    seed: int = 0
    algorithm: Literal["max", "smoothquant", "percentile"] = "max"


class QuantizationSettings(Strict):
    calibration: CalibrationSettings = CalibrationSettings()
    exclude: list[str] = Field(default_factory=list, description="module-name patterns kept in higher precision")


class ParityThresholds(Strict):
    min_psnr_db: float | None = None
    min_ssim: float | None = Field(None, ge=-1.0, le=1.0)
    max_lpips: float | None = Field(None, ge=0.0)


class StepCacheGate(Strict):
    """A cached variant's parity gate against the uncached fp32 reference (default: step_cache.DEFAULT_GATES)."""

    min_psnr_db: float | None = None
    min_ssim: float | None = Field(None, ge=-1.0, le=1.0)


class StepCacheSettings(Strict):
    """`step_cache:` of a model (docs/step-cache.md). Which keys fit which method, and which family a method fits,
    is checked in load.py (where the family is known), each with its line."""

    method: StepCacheMethod
    interval: int | None = Field(None, description="deepcache: a full UNet step every N steps (N >= 2)")
    branch: int | None = Field(None, description="deepcache: the skip level the UNet is cut at (0: shallowest)")
    threshold: float | None = Field(None, description="first_block: the first block's relative residual change "
                                                      "below which the remaining blocks are skipped (> 0)")
    enabled: bool = Field(True, description="STEP_CACHE's default for a request that does not send it")
    gate: StepCacheGate = StepCacheGate()


class TensorRTSettings(Strict):
    optimization_level: int = Field(3, ge=0, le=5)
    # the builder's workspace pool cap; None (default): no cap, as NVIDIA's demo/Diffusion builds (large attention
    # tactics for Wan 720p or 2K FLUX need more than 8 GiB). Part of the engine keys only when set.
    workspace_gb: float | None = Field(None, gt=0)
    # The GPU architectures a release serves: each becomes an engine of its own (its key and name change),
    # built on a host with that GPU (`build --ray` asks for a Ray resource of the same name). Empty: the
    # architecture of the GPU that builds.
    architectures: list[Annotated[str, Field(pattern=r"^sm_[0-9]{2,3}[a-z]?$")]] = Field(default_factory=list)
    # TensorRT 11.3 can drop a GEMM bias in REFIT engines (NVIDIA's known issue): `build` refuses refittable
    # specs on 11.3.x unless this is true (then part of the engines' identity: they rebuild when it changes)
    allow_refit_on_11_3: bool = False
    # Build options of every TensorRT engine (docs/tensorrt.md); each is part of the engines' keys only when it is
    # not the default, so adding these fields changed no existing key
    version_compatible: bool = False  # VERSION_COMPATIBLE: loads on newer TensorRT (10 -> 11); lean runtime in the plan
    strip_plan: bool = False  # STRIP_PLAN: plans without weights, refitted from their ONNX at load
    weight_streaming: bool = False  # WEIGHT_STREAMING: weights may stream from host memory within a runner budget
    tf32: bool = True  # TF32 math in fp32 layers
    # per_shape: one plan per bucket × batch shape, each with every weight; profiles: one engine per weight set
    # (model, component, ControlNet, precision, LoRA variant, GPU architecture) with one optimization profile per
    # shape, the weights held once (docs/tensorrt.md). Not a build option: the specs themselves change (one spec
    # with `profiles` per weight set), so per_shape keys stay what they were.
    engine_layout: Literal["per_shape", "profiles"] = "per_shape"


class FarmSettings(Strict):
    """`build --ray`: which Ray resources an engine's task asks for, keyed by target or target/component
    (the more specific key wins), e.g. {"onnxruntime/unet": {"big_memory": 1}, "onnxruntime": {"cpu": 1}}."""

    resources: dict[str, dict[str, Annotated[float, Field(gt=0)]]] = Field(default_factory=dict)
    max_retries: int = Field(2, ge=0, le=10)  # a task whose worker dies is retried this often, then reported


class BuildSettings(Strict):
    # A folder (relative to engines.yaml), a shared directory (file:///mnt/nfs/build) or an object store through
    # fsspec (s3://bucket/prefix): stages then work in a local cache of it, pulled and published (workspace/store_sync.py)
    workspace: str = "build"
    cache: str | None = None  # a URL workspace's local cache; default ~/.cache/trt-diffusion/<hash of the URL>
    timing_cache: str | None = None  # default: <workspace>/timing-cache
    opset: int = Field(20, ge=18, le=23)  # dynamo export: opset 17 gives graphs ORT rejects; 18-23 work
    jobs: int = Field(1, ge=1)
    memory_budget_gb: float = Field(16.0, gt=0)
    # manifest: package/serve check each engine against its own manifest's sha256 (any writer of the workspace
    # can re-seal); signed: they also require a release manifest signed by a key given to --verify (signing.py)
    trust: Literal["manifest", "signed"] = "manifest"
    tensorrt: TensorRTSettings = TensorRTSettings()
    farm: FarmSettings = FarmSettings()


PrecisionMap = dict[Component, Precision]


class OverloadDegrade(Strict):
    """What a degraded request runs with: fewer steps, or a smaller served size (one of the model's buckets,
    "WxH"); one of them. (`size`, not `bucket`: engines.yaml's did-you-mean reads every key of the schema.)"""

    steps: int | None = Field(None, ge=1)
    size: Annotated[str, AfterValidator(_static_bucket)] | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.steps is None) == (self.size is None):
            raise ValueError("give one of steps (fewer denoising steps) or size (a smaller served WxH)")
        return self


class OverloadSettings(Strict):
    """`serving: overload:` (docs/deploy.md): past `degrade_after_s` of estimated wait a request runs degraded,
    past `refuse_after_s` it is refused (429 with Retry-After); off when absent."""

    degrade_after_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    refuse_after_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    degrade: OverloadDegrade | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if (self.degrade_after_s is None) != (self.degrade is None):
            raise ValueError("degrade_after_s and degrade go together: when to degrade, and to what")
        if self.degrade_after_s is None and self.refuse_after_s is None:
            raise ValueError("give degrade_after_s (with degrade), refuse_after_s, or both; leave overload out "
                             "to keep it off")
        if None not in (self.degrade_after_s, self.refuse_after_s) and self.refuse_after_s <= self.degrade_after_s:
            raise ValueError(f"refuse_after_s ({self.refuse_after_s:g}) must be above degrade_after_s "
                             f"({self.degrade_after_s:g}): a request is degraded before it is refused")
        return self


class ServingSettings(Strict):
    """`serving:` of a model: how its engines are run when served, not how they are built (no engine key changes)."""

    overload: OverloadSettings | None = None  # degrade or refuse by the estimated wait (off: None)

    # a TensorRT engine built with weight streaming (build: tensorrt: weight_streaming: true) keeps this many GB of
    # its streamable weights on the GPU (weight_streaming_budget_v2) where trt-diffusion's runner loads it
    # (in-process pipelines, python-backend Triton models); None: every weight resident. docs/tensorrt.md
    tensorrt_weight_budget_gb: float | None = Field(None, ge=0)


class ModelSettings(Strict):
    """Fields a model may set and `defaults` may supply."""

    components: list[Component] | None = None
    # txt2img | img2img | inpaint | edit; default: what the checkpoint is for (an inpainting checkpoint inpaints,
    # a Kontext one edits, any other generates from text). Image workflows add the VAE encoder.
    workflows: list[Workflow] | None = None
    buckets: list[BucketEntry] | None = None
    batch: list[Annotated[int, Field(ge=1)]] | None = None
    cfg: list[CfgMode] | None = None  # batched | split | parallel | none (any of them together)
    precision: PrecisionMap | None = None
    targets: list[Target] | None = None
    refittable: bool | None = None
    quantization: QuantizationSettings | None = None
    parity: dict[Precision, ParityThresholds] | None = None
    text_length: TextLength | None = None  # qwen_image only: the text encoder's and transformer's token range
    step_cache: StepCacheSettings | None = None  # deepcache (sd15, sdxl) or first_block (flux): docs/step-cache.md
    serving: ServingSettings | None = None  # how the engines are run when served (ServingSettings)

    @field_validator("cfg", "targets", "batch", "components", "buckets", "workflows", mode="before")
    @classmethod
    def _one_or_many(cls, value):
        return value if value is None or isinstance(value, list) else [value]

    @field_validator("cfg", "targets", "batch", "components", "buckets", "workflows")
    @classmethod
    def _not_empty(cls, value):
        # An empty list is never meant: `buckets: []` would plan text encoders only, `targets: []` nothing.
        if value is not None and not value:
            raise ValueError("must list at least one value (leave the key out for the default)")
        return value


class ModelEntry(ModelSettings):
    source: Source
    family: Family
    controlnets: dict[Name, ControlNetEntry] = Field(default_factory=dict)
    loras: dict[Name, LoraEntry] = Field(default_factory=dict)


class EnginesFile(Strict):
    version: Literal[1]
    build: BuildSettings = BuildSettings()
    defaults: ModelSettings = ModelSettings()
    models: dict[Name, ModelEntry] = Field(min_length=1)
    preflight: PreflightSettings = PreflightSettings()  # the pre-launch checklist (engines_file/preflight.py)


BUILTIN_DEFAULTS = {
    "buckets": ["512x512"],
    "batch": [1],
    "cfg": [CfgMode.batched],
    "targets": None,  # targets.default_target_names(), read when a file is resolved
    "refittable": False,
    # fp32 VAE by default: fp16 VAEs overflow into black/NaN images.
    "precision": {Component.vae_encoder: Precision.fp32, Component.vae_decoder: Precision.fp32},
    "precision_fallback": Precision.fp16,
}
