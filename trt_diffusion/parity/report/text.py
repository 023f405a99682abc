"""How report values read, in the HTML page and the terminal alike: worst metrics per variant, dB and
ratio formatting (inf/NaN/missing), verdicts, thresholds."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ...metrics import Thresholds
from .model import VariantResult


def format_db(value: float | None) -> str:
    if value is None:
        return "—"
    if math.isinf(value):
        return "∞ dB" if value > 0 else "-∞ dB"
    return "NaN" if math.isnan(value) else f"{value:.2f} dB"


def format_ratio(value: float | None) -> str:
    if value is None:
        return "—"
    return "NaN" if math.isnan(value) else f"{value:.4f}"


def worst(values: Sequence[float], lower_is_worse: bool) -> float | None:
    """The worst value; NaN counts as worst of all (it means a broken output)."""
    if not values:
        return None
    if any(math.isnan(v) for v in values):
        return math.nan
    return min(values) if lower_is_worse else max(values)


def min_psnr(variant: VariantResult) -> float | None:
    return worst([image.psnr_db for image in variant.images], lower_is_worse=True)


def min_ssim(variant: VariantResult) -> float | None:
    return worst([image.ssim for image in variant.images], lower_is_worse=True)


def max_lpips(variant: VariantResult) -> float | None:
    return worst([image.lpips for image in variant.images if image.lpips is not None], lower_is_worse=False)


def lpips_note(variant: VariantResult) -> str:
    """The LPIPS column: the worst value, or 'n/a' when no image has one."""
    value = max_lpips(variant)
    return "n/a" if value is None else format_ratio(value)


def lpips_missing_reason(variant: VariantResult) -> str:
    return next((image.lpips_reason for image in variant.images if image.lpips_reason), "")


def verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def thresholds_text(thresholds: Thresholds) -> str:
    text = f"PSNR ≥ {thresholds.min_psnr_db:g} dB, SSIM ≥ {thresholds.min_ssim:g}"
    return text + (f", LPIPS ≤ {thresholds.max_lpips:g}" if thresholds.max_lpips is not None else ", LPIPS not gated")


def check_text(value: bool | None) -> str:
    return "not checked" if value is None else ("yes" if value else "NO")


def first_failure(variant: VariantResult) -> str:
    """The first failure reason, with how many more there are; empty when the variant passed."""
    reasons = variant.failure_reasons
    if not reasons:
        return ""
    return reasons[0] + (f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else "")
