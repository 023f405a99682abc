"""Step caching: the vocabulary every stage shares (methods, their settings, defaults, gates, schedules).

Two methods this round (docs/step-cache.md):

- `deepcache` (UNet families): every `interval`-th step runs the whole UNet and keeps the feature entering the
  up block at skip level `branch`; the steps between run only the shallow path (conv_in, the first down layers,
  the last up layers) on that cached deep feature (Ma et al., DeepCache, CVPR 2024).
- `first_block` (DiT families): every step runs the first transformer block; when its residual changed by less
  than `threshold` (mean |Δ| / mean |previous|) since the last full step, the remaining blocks are skipped and
  their cached residual added instead (diffusers' FirstBlockCacheConfig, ParaAttention's first-block cache).

Pure data: no torch, so engines.yaml validation and `plan` stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .families import FAMILIES, Family


class StepCacheMethod(str, Enum):
    __str__ = str.__str__

    deepcache = "deepcache"
    first_block = "first_block"


def method_families(method: StepCacheMethod | str) -> tuple[Family, ...]:
    """Which families a method applies to, as their declarations say (families/<name>.py `step_cache`): DeepCache
    needs a UNet's skip connections, first-block caching a stack of transformer blocks whose first block's residual
    predicts the rest (FLUX's double-stream blocks)."""
    return tuple(f for f, info in FAMILIES.items() if StepCacheMethod(method).value in info.step_cache)

DEFAULT_INTERVAL = 3  # DeepCache's SD1.5 setting (N=3 keeps FID close to the uncached model in the paper)
DEFAULT_BRANCH = 0  # the shallowest skip branch: the most work skipped, the paper's SD1.5 choice
DEFAULT_THRESHOLD = 0.08  # within the 0.05–0.12 diffusers and ParaAttention recommend for FLUX.1

# Default parity gates of a cached variant against the *uncached fp32 reference* (not against its own
# engine): lower than an engine's own gate, because a cache changes the computation by design. DeepCache's
# paper reports SD1.5 at N=3 within ~0.3 CLIP score and a few FID of the uncached model, where its images
# differ visibly in fine detail (PSNR in the mid 20s dB); first-block caching at 0.08 is reported as
# near-lossless on FLUX.1 (images near 30 dB and above). Both are configurable per model (`step_cache.gate`).
DEFAULT_GATES: dict[StepCacheMethod, tuple[float, float]] = {  # (min PSNR dB, min SSIM)
    StepCacheMethod.deepcache: (24.0, 0.80),
    StepCacheMethod.first_block: (30.0, 0.90),
}


class StepCacheMode(str, Enum):
    """A request's STEP_CACHE input."""

    __str__ = str.__str__

    on = "on"
    off = "off"


@dataclass(frozen=True)
class StepCache:
    """A model's resolved step cache (engines.yaml `step_cache:`)."""

    method: StepCacheMethod
    interval: int = DEFAULT_INTERVAL  # deepcache only
    branch: int = DEFAULT_BRANCH  # deepcache only
    threshold: float = DEFAULT_THRESHOLD  # first_block only
    min_psnr_db: float | None = None  # None: DEFAULT_GATES
    min_ssim: float | None = None
    enabled: bool = True  # the STEP_CACHE default of a request that does not say

    @property
    def gate(self) -> tuple[float, float]:
        psnr, ssim = DEFAULT_GATES[self.method]
        return (psnr if self.min_psnr_db is None else self.min_psnr_db,
                ssim if self.min_ssim is None else self.min_ssim)

    def engine_option(self) -> str:
        """What changes the cached engines' graphs (enters their spec keys): the interval and the threshold do
        not (they are run-time schedule), the branch does (where the UNet is cut)."""
        if self.method is StepCacheMethod.deepcache:
            return f"{self.method.value}:branch={self.branch}"
        return self.method.value

    def describe(self) -> str:
        if self.method is StepCacheMethod.deepcache:
            return f"deepcache interval {self.interval}, branch {self.branch}"
        return f"first_block threshold {self.threshold:g}"


# The engines a method adds beside the uncached denoiser (which STEP_CACHE=off and every full step of
# first_block keep using): DeepCache's full UNet that also emits the deep feature, and the shallow path that takes
# it; first-block caching's first block (emitting its residual) and the remaining blocks.
PIECES: dict[StepCacheMethod, tuple[str, ...]] = {
    StepCacheMethod.deepcache: ("unet_deep", "unet_shallow"),
    StepCacheMethod.first_block: ("first_block", "rest_blocks"),
}

# Methods whose pieces the quantize stage exports as Q/DQ graphs for an int8/fp8 denoiser, from the denoiser's own
# calibration (quantize/pieces.py); engines.yaml refuses a step cache of any other method on a quantized denoiser.
QUANTIZED_METHODS: frozenset[StepCacheMethod] = frozenset({StepCacheMethod.deepcache, StepCacheMethod.first_block})


def deepcache_full_steps(steps: int, interval: int) -> tuple[bool, ...]:
    """Per step: True where the whole UNet runs (DeepCache's uniform schedule: step 0, interval, 2·interval…)."""
    if interval < 1:
        raise ValueError(f"interval must be at least 1, got {interval}")
    return tuple(i % interval == 0 for i in range(steps))


def first_block_skips(residual, previous, threshold: float) -> bool:
    """Whether a first-block-cached step skips the remaining blocks: the first block's residual changed, since the
    last full step's, by at most `threshold` (mean |Δ| over mean |previous|), computed as diffusers' hook does (torch,
    float32, so the decision is the hook's bit for bit). `residual`, `previous`: torch tensors or numpy arrays."""
    import torch

    residual, previous = torch.as_tensor(residual), torch.as_tensor(previous)
    change = (residual - previous).abs().mean() / previous.abs().mean()
    return not bool(change.item() > threshold)


def schedule_label(full: tuple[bool, ...] | list[bool]) -> str:
    """A schedule as a report shows it: F for a full step, c for a cached one ("FccFccF")."""
    return "".join("F" if f else "c" for f in full)
