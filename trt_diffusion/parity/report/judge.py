"""Judging: image and clip metrics against a variant's thresholds, the reasons a variant fails, the verdict of a
variant and of a report, tool versions. The models (`model`) hold results; this module makes them."""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime

import numpy as np

from ...metrics import Thresholds, lpips_distance, psnr, ssim, video_metrics
from ...workspace.files import tool_versions
from .model import ComponentDiff, ImageComparison, ParityReport, VariantResult, VideoComparison


def collect_tool_versions() -> dict[str, str]:
    """Python and the installed versions of the packages that shape a parity result."""
    installed = {name: version for name, version in tool_versions("parity").items() if version is not None}
    return {"python": platform.python_version(), **installed}


def compare_image(
    *,
    prompt: str,
    seed: int,
    reference: np.ndarray,
    candidate: np.ndarray,
    thresholds: Thresholds,
    reference_png: str,
    candidate_png: str,
    compute_lpips: bool = True,
) -> ImageComparison:
    """PSNR, SSIM and (when available) LPIPS of two uint8 HxWx3 images, judged against `thresholds`.

    Two clips [F, H, W, 3] (a video family's output) are compared frame by frame: the comparison holds the worst
    frame's PSNR and SSIM, the LPIPS of the worst-PSNR frame (one frame: LPIPS of every frame costs a network pass
    each) and the clip's figures (`video`); its motion is judged too. `reference_png` / `candidate_png` then name
    the frame strips write_report makes of the clips.
    """
    video = None
    if np.ndim(reference) == 4:
        figures = video_metrics(reference, candidate)
        video = VideoComparison.from_metrics(figures)
        psnr_db, ssim_value = figures.min_psnr_db, figures.min_ssim
        reference, candidate = reference[figures.worst_psnr_frame], candidate[figures.worst_psnr_frame]
    else:
        psnr_db, ssim_value = psnr(reference, candidate), ssim(reference, candidate)
    if compute_lpips:
        lpips_result = lpips_distance(reference, candidate)
        lpips_value, lpips_reason = lpips_result.value, lpips_result.reason
    else:
        lpips_value, lpips_reason = None, "LPIPS not computed: disabled for this run"
    comparison = ImageComparison(
        prompt=prompt,
        seed=seed,
        psnr_db=psnr_db,
        ssim=ssim_value,
        lpips=lpips_value,
        lpips_reason=lpips_reason,
        passed=False,  # judged below, with the clip's motion where there is one
        reference_png=reference_png,
        candidate_png=candidate_png,
        video=video,
    )
    return judge_image(comparison, thresholds)


def image_failures(image: ImageComparison, thresholds: Thresholds) -> list[str]:
    """Why an image misses the bar; for a clip, its worst frames' PSNR/SSIM and its motion."""
    failures = thresholds.image_failures(image.psnr_db, image.ssim, image.lpips, image.lpips_reason)
    if image.video is not None:
        failures += thresholds.motion_failures(image.video.motion_rmse, image.video.reference_motion)
    return failures


def judge_image(image: ImageComparison, thresholds: Thresholds) -> ImageComparison:
    return image.model_copy(update={"passed": not image_failures(image, thresholds)})


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def variant_failures(
    images: Sequence[ImageComparison],
    thresholds: Thresholds,
    components: Iterable[ComponentDiff] = (),
    reproducible: bool | None = None,
    batch_independent: bool | None = None,
) -> list[str]:
    """Every reason a variant fails, in a stable order (empty when it passes)."""
    reasons = [] if images else ["no images were compared"]
    for index, image in enumerate(images):
        failures = image_failures(image, thresholds)
        if failures and image.video is None:
            reasons.append(f"image {index} (seed {image.seed}, {_short(image.prompt)!r}): " + "; ".join(failures))
        elif failures:
            video = image.video
            reasons.append(f"video {index} (seed {image.seed}, {_short(image.prompt)!r}; worst frames: PSNR "
                           f"{video.worst_psnr_frame}, SSIM {video.worst_ssim_frame}): " + "; ".join(failures))
    for diff in components:
        if diff.nan_count or diff.inf_count:
            reasons.append(f"{diff.component}.{diff.output}: {diff.nan_count} NaN and {diff.inf_count} inf values")
    if reproducible is False:
        reasons.append("not reproducible: the same seed gave different images on two runs")
    if batch_independent is False:
        reasons.append("batch-dependent: an image changed with the batch it was generated in")
    return reasons


def judge_variant(
    *,
    variant_id: str,
    model: str,
    target: str,
    precision: str,
    bucket: str,
    thresholds: Thresholds,
    images: Sequence[ImageComparison],
    components: Sequence[ComponentDiff] = (),
    reproducible: bool | None = None,
    batch_independent: bool | None = None,
    lora: str | None = None,
    controlnet: str | None = None,
    extra_failures: Sequence[str] = (),
    failing_engines: Sequence[str] = (),
) -> VariantResult:
    """Judge the parts against `thresholds`: sets each image's `passed`, the reasons and the verdict."""
    judged = [judge_image(image, thresholds) for image in images]
    reasons = variant_failures(judged, thresholds, components, reproducible, batch_independent)
    reasons += list(extra_failures)
    return VariantResult(
        variant_id=variant_id, model=model, target=target, precision=precision, bucket=bucket, lora=lora,
        controlnet=controlnet, thresholds=thresholds, images=judged, components=list(components),
        reproducible=reproducible, batch_independent=batch_independent, passed=not reasons,
        failure_reasons=reasons, failing_engines=list(dict.fromkeys(failing_engines)),
    )


def judge_report(
    variants: Sequence[VariantResult],
    tool_versions: Mapping[str, str] | None = None,
    created_at: datetime | None = None,
) -> ParityReport:
    """The report of these variants: it passes only if there is one and every variant passes."""
    variants = list(variants)
    return ParityReport(
        created_at=created_at or datetime.now(UTC),
        tool_versions=dict(collect_tool_versions() if tool_versions is None else tool_versions),
        variants=variants,
        passed=bool(variants) and all(variant.passed for variant in variants),
    )
