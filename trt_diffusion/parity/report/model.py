"""The parity report's data model: pydantic models with their JSON Schema and consistency checks.

Non-finite floats (PSNR of identical images is inf; a NaN-producing engine gives NaN) are written to
JSON as the strings "Infinity", "-Infinity" and "NaN": plain JSON has no such numbers, a large
sentinel would read as a real measurement, and these strings round-trip through
`ParityReport.model_validate_json`, Python's `float()` and JavaScript's `Number()`.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import PurePosixPath
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    WithJsonSchema,
    model_serializer,
    model_validator,
)

from ...metrics import TensorDiff, Thresholds, VideoMetrics

REPORT_SCHEMA_VERSION = 1


def relative_file_name(name: str, suffix: str) -> str:
    """A `suffix` file's path relative to the report folder: no absolute paths, no '..', no backslashes."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or "\\" in name or str(path) != name:
        raise ValueError(f"{name!r} must be a plain relative path inside the report folder")
    if path.suffix.lower() != suffix:
        raise ValueError(f"{name!r} must be a {suffix} file")
    return name


def relative_png_name(name: str) -> str:
    return relative_file_name(name, ".png")


PngName = Annotated[str, AfterValidator(relative_png_name)]
WebpName = Annotated[str, AfterValidator(lambda name: relative_file_name(name, ".webp"))]

# A float that may be inf or NaN: serialized as "Infinity"/"-Infinity"/"NaN" (see module docstring),
# and the JSON Schema says so.
MetricFloat = Annotated[
    float,
    WithJsonSchema({"anyOf": [{"type": "number"}, {"enum": ["Infinity", "-Infinity", "NaN"]}]}),
]


class _ReportModel(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")


class VideoComparison(_ReportModel):
    """A same-seed clip pair's figures frame by frame and in motion (metrics.VideoMetrics). Its ImageComparison
    holds the worst frame's PSNR and SSIM (what the thresholds gate, beside the motion), the LPIPS of the worst-PSNR
    frame, and the clips' frame strips as reference_png / candidate_png."""

    frames: int = Field(ge=1)
    psnr_db: list[MetricFloat] = Field(description="PSNR in dB of each frame")
    ssim: list[MetricFloat] = Field(description="SSIM of each frame")
    worst_psnr_frame: int = Field(ge=0, description="the frame with the lowest PSNR (a NaN frame first)")
    worst_ssim_frame: int = Field(ge=0, description="the frame with the lowest SSIM (a NaN frame first)")
    mean_psnr_db: MetricFloat = Field(description="PSNR of the frames' mean squared error (the clip's PSNR)")
    mean_ssim: MetricFloat = Field(description="mean SSIM over the frames")
    motion_rmse: MetricFloat = Field(description="RMS of the difference of the clips' frame-to-frame changes")
    reference_motion: MetricFloat = Field(description="RMS of the reference's frame-to-frame changes")
    motion_error: MetricFloat = Field(description="motion_rmse / reference_motion: 0 exact, 1 as wrong as a still")
    strip_frames: list[int] = Field(default_factory=list, description="the frames in the strips, written by "
                                                                      "write_report")
    reference_preview: WebpName | None = Field(default=None, description="the reference clip, looped; written by "
                                                                        "write_report")
    candidate_preview: WebpName | None = Field(default=None, description="the engine's clip, looped; written by "
                                                                        "write_report")

    @classmethod
    def from_metrics(cls, video: VideoMetrics) -> VideoComparison:
        return cls(frames=video.frames, psnr_db=list(video.psnr_db), ssim=list(video.ssim),
                   worst_psnr_frame=video.worst_psnr_frame, worst_ssim_frame=video.worst_ssim_frame,
                   mean_psnr_db=video.mean_psnr_db, mean_ssim=video.mean_ssim, motion_rmse=video.motion_rmse,
                   reference_motion=video.reference_motion, motion_error=video.motion_error)

    @model_validator(mode="after")
    def _one_figure_per_frame(self) -> VideoComparison:
        if not len(self.psnr_db) == len(self.ssim) == self.frames:
            raise ValueError(f"{self.frames} frames but {len(self.psnr_db)} PSNR and {len(self.ssim)} SSIM values")
        if max(self.worst_psnr_frame, self.worst_ssim_frame, *self.strip_frames) >= self.frames:
            raise ValueError(f"a frame index beyond the clip's {self.frames} frames")
        return self


class ImageComparison(_ReportModel):
    """One same-seed image pair: the reference pipeline's image against the engine pipeline's; or a clip pair
    (`video` set: see VideoComparison)."""

    prompt: str
    seed: int = Field(description="the generator seed both pipelines used")
    psnr_db: MetricFloat = Field(description='PSNR in dB over 8-bit RGB; "Infinity" when identical')
    ssim: MetricFloat = Field(description="SSIM, 1.0 when identical")
    lpips: MetricFloat | None = Field(
        default=None, description="LPIPS (AlexNet), 0 when identical; null if not computed"
    )
    lpips_reason: str | None = Field(default=None, description="why lpips is null")
    passed: bool = Field(description="whether this image meets the variant's thresholds")
    reference_png: PngName = Field(description="the reference image, relative to the report folder")
    candidate_png: PngName = Field(description="the engine's image, relative to the report folder")
    init_png: PngName | None = Field(default=None, description="the init image both pipelines started from "
                                                               "(image-conditioned workflows; img2vid: the clip's "
                                                               "first frame)")
    mask_png: PngName | None = Field(default=None, description="the inpainting mask (white = repainted)")
    diff_png: PngName | None = Field(default=None, description="the |diff| heatmap, written by write_report")
    video: VideoComparison | None = Field(default=None, description="a clip pair's figures; absent for images")

    @model_validator(mode="after")
    def _lpips_has_value_or_reason(self) -> ImageComparison:
        if self.lpips is None and not self.lpips_reason:
            raise ValueError("lpips_reason is required when lpips is null")
        return self

    @model_serializer(mode="wrap")
    def _images_as_before(self, handler: SerializerFunctionWrapHandler):
        # an image's record stays what it was before clips existed: no "video": null
        data = handler(self)
        if self.video is None:
            data.pop("video", None)
        return data


class ComponentDiff(_ReportModel):
    """One output of one component (e.g. unet.out_sample) against the PyTorch reference."""

    component: str
    output: str
    shape: list[int]
    max_abs: MetricFloat = Field(description="max |reference - candidate| over positions finite in both")
    mean_abs: MetricFloat = Field(description="mean |reference - candidate| over positions finite in both")
    max_rel: MetricFloat = Field(description="max_abs / max |reference|")
    nan_count: int = Field(ge=0, description="NaN values in the candidate")
    inf_count: int = Field(ge=0, description="+-inf values in the candidate")

    @classmethod
    def from_tensor_diff(cls, component: str, output: str, diff: TensorDiff) -> ComponentDiff:
        return cls(
            component=component,
            output=output,
            shape=list(diff.shape),
            max_abs=diff.max_abs,
            mean_abs=diff.mean_abs,
            max_rel=diff.max_rel,
            nan_count=diff.nan_count,
            inf_count=diff.inf_count,
        )


class PromptFollowing(_ReportModel):
    """Does the engine still draw the prompt? The synthetic world's reading of the variant's images (percent of
    images whose background, shape colour, shape class and style match the prompt), for the reference and the
    engine; the engine fails when an aspect is more than `margin` points below the reference's."""

    reference: dict[str, float]
    engine: dict[str, float]
    margin: float = Field(description="points an aspect of the engine may fall below the reference's")
    images: int


class VariantResult(_ReportModel):
    """Everything compared for one engine variant (model x target x precision x bucket x lora/controlnet)."""

    variant_id: str = Field(description="unique within the report")
    model: str
    target: str = Field(description="the target the engines were built for (tensorrt, onnxruntime, openvino, ...)")
    precision: str = Field(description="fp32, fp16, bf16, fp8 or int8; selects the default thresholds")
    bucket: str = Field(description="the resolution bucket label, e.g. 512x512 or 512x512..1024x1024")
    lora: str | None = None
    controlnet: str | None = None
    workflow: str = Field(default="txt2img", description="txt2img, img2img, inpaint, edit or img2vid")
    strength: float | None = Field(default=None, description="the img2img/inpaint strength the requests used")
    step_cache: str | None = Field(default=None, description="the step cache the engines ran (e.g. 'deepcache "
                                   "interval 3, branch 0'), judged against the uncached fp32 reference; null: none")
    step_schedule: str | None = Field(default=None, description="a step-cached variant's schedule: F a full "
                                      "step, c a cached one")
    thresholds: Thresholds = Field(description="the bar the images were judged against")
    images: list[ImageComparison] = Field(default_factory=list)
    components: list[ComponentDiff] = Field(default_factory=list)
    reproducible: bool | None = Field(
        default=None, description="same seed twice gave identical images; null: not checked"
    )
    batch_independent: bool | None = Field(
        default=None, description="images do not change with their batch; null: not checked"
    )
    prompt_following: PromptFollowing | None = Field(
        default=None, description="for a model that declares the synthetic world (a micro-model): whether the engine "
        "still draws the prompt; null: not applicable (a user's checkpoint)")
    passed: bool
    failure_reasons: list[str] = Field(default_factory=list, description="empty exactly when passed")
    failing_engines: list[str] = Field(
        default_factory=list, description="engines whose own outputs diverge from their PyTorch module"
    )

    @model_validator(mode="after")
    def _verdict_matches_reasons(self) -> VariantResult:
        # A failure must say why, and a pass must not hide a failed image.
        if self.passed and (self.failure_reasons or not all(image.passed for image in self.images)):
            raise ValueError(f"variant {self.variant_id!r} is marked passed but has failures")
        if not self.passed and not self.failure_reasons:
            raise ValueError(f"variant {self.variant_id!r} is marked failed without a failure reason")
        return self


class ParityReport(_ReportModel):
    """The whole parity run: one VariantResult per engine variant. Passes only if every variant does."""

    schema_version: Literal[1] = REPORT_SCHEMA_VERSION
    created_at: datetime
    tool_versions: dict[str, str] = Field(default_factory=dict)
    variants: list[VariantResult]
    passed: bool

    @model_validator(mode="after")
    def _consistent(self) -> ParityReport:
        ids = [variant.variant_id for variant in self.variants]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"duplicate variant ids: {duplicates}")
        # An empty report does not pass: comparing nothing proves nothing.
        expected = bool(self.variants) and all(variant.passed for variant in self.variants)
        if self.passed != expected:
            raise ValueError(f"report passed={self.passed} but its variants say {expected}")
        return self
