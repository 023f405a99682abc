"""What a request to a pipeline is and what it gives back: the request, its stage timings, its generation, a
prompt's encoding and the step callback. Their own module so the family loops import them without importing the
hub (runtime/pipeline.py) that dispatches to them: no import, not even a type-only one, goes back from a loop
into the hub."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..families import RequestInput
from ..workflows import DEFAULT_STRENGTH, Workflow, request_workflow


@dataclass
class GenerationRequest:
    prompt: str
    height: int
    width: int
    negative_prompt: str | None = None  # None: the family's default (SDXL: zeros)
    steps: int = 20
    guidance_scale: float = 7.5
    seed: int = 0
    scheduler: str = "default"
    batch: int = 1  # images for this prompt
    controlnet: str | None = None
    control_image: np.ndarray | None = None  # uint8 [H, W, 3]
    controlnet_scale: float = 1.0
    workflow: str | None = None  # None: what init_image/mask/frames imply (workflows.request_workflow)
    init_image: np.ndarray | None = None  # uint8 [H, W, 3], the bucket's size (never resized); img2vid: frame 1
    mask: np.ndarray | None = None  # uint8 [H, W]; white (>= 128) is repainted
    strength: float | None = None  # (0, 1]; None: the workflow's default (workflows.DEFAULT_STRENGTH)
    frames: int = 0  # a video family's clip length (Wan: 4k+1); 0: an image
    guidance_scale_2: float | None = None  # Wan 2.2 two-expert: the low-noise expert's guidance (None: guidance_scale)
    # qwen_image: prompt tokens kept after the template (diffusers' max_sequence_length); None: 512, or the engines'
    # text_length max where lower. Longer prompts are truncated to it, as diffusers does; above the engines' max refused
    max_sequence_length: int | None = None
    # LoRAs applied by the engines for this request (served: triton/lora_sets.py's canonical set, sorted by name,
    # no scale 0); requests with different sets never share a denoiser call (batch_key)
    loras: tuple = ()
    step_cache: str | None = None  # "on" | "off" (STEP_CACHE); None: engines.yaml's step_cache.enabled
    # the request inputs the family adds (its declaration's `request_inputs`: Z-Image's cfg_normalization and
    # cfg_truncation), by diffusers' argument; one left out runs at its declared default (`input_value`)
    inputs: dict[str, float] = field(default_factory=dict)

    @property
    def resolved_workflow(self) -> Workflow:
        video = isinstance(self.frames, (int, float, np.number)) and self.frames > 0  # a bad FRAMES is named apart
        return request_workflow(self.workflow, self.init_image is not None, self.mask is not None, video=video)

    @property
    def resolved_strength(self) -> float:
        if self.strength is not None:
            return float(self.strength)
        return DEFAULT_STRENGTH.get(self.resolved_workflow, 1.0)


def input_problems(declared: tuple[RequestInput, ...], request: GenerationRequest) -> list[str]:
    """What is wrong with a request's family inputs: one the family does not declare, or a value out of its range
    (each named as on the wire: CFG_TRUNCATION)."""
    known = {d.argument: d for d in declared}
    problems = []
    for argument, value in request.inputs.items():
        if argument not in known:
            takes = ", ".join(d.name for d in declared) or "none beyond every family's"
            problems.append(f"{str(argument).upper()} is not an input of this model (its family's inputs: {takes})")
        elif (why := known[argument].problem(value)) is not None:
            problems.append(why)
    return problems


def input_value(request: GenerationRequest, declared: RequestInput) -> float:
    """The request's value of a family input, or its declared default (diffusers')."""
    return declared.data_type(request.inputs.get(declared.argument, declared.default))


@dataclass
class StageTimings:
    text_encode_s: float = 0.0
    image_encode_s: float = 0.0  # img2vid: the CLIP image embeds and the conditioning clip's VAE encode
    step_s: list[float] = field(default_factory=list)
    vae_decode_s: float = 0.0
    batch: int = 1  # requests whose rows shared the denoiser calls (generate_batch)
    wait_s: float = 0.0  # time spent, before this request's batch started, on other batches of the same call
    step_schedule: str = ""  # a step-cached request's schedule ("FccFcc": full and cached steps); "": uncached

    @property
    def total_s(self) -> float:
        return self.text_encode_s + self.image_encode_s + sum(self.step_s) + self.vae_decode_s

    def to_json(self) -> dict:
        return {"text_encode_s": self.text_encode_s, "image_encode_s": self.image_encode_s, "steps_s": self.step_s,
                "vae_decode_s": self.vae_decode_s, "total_s": self.total_s, "batch": self.batch,
                "wait_s": self.wait_s}


@dataclass
class Generation:
    images: np.ndarray  # uint8 [B, H, W, 3]; a video family's [B, F, H, W, 3]
    timings: StageTimings
    cfg_mode: str  # batched | split | parallel | none


@dataclass
class _Conditioning:
    embeds: np.ndarray  # [B, S, C]
    pooled: np.ndarray | None = None
    mask: np.ndarray | None = None  # qwen_image: [B, S] int64, 1 for the prompt's tokens (rows have their own S)


Conditioning = _Conditioning


@dataclass
class PromptEncoding:
    positive: Conditioning
    negative: Conditioning | None  # None where CFG does not run


# (step index, number of steps, latents of each request of the batch): called after every scheduler step
StepCallback = Callable[[int, int, list[torch.Tensor]], None]
