"""Calibration data: the denoiser's real inputs, as the diffusers pipeline generates, seeded.

Each prompt runs the full pipeline (text encoders, scheduler, CFG) for `steps` steps with its own
`torch.Generator` seeded from the settings (a video family's pipeline at the recipe's frame count: Wan's
WanPipeline, CFG as two batch-1 calls, Wan 2.2's experts switched at its boundary as it does). The same
recipe therefore yields the same inputs, and the same inputs the same scales. ModelOpt's statistics are taken
during those generations (`calibration_loop`: while calibrating, its quantizers pass values through unchanged,
so the trajectory is the fp32 one); recording the calls to replay them afterwards would run every denoiser
call twice.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .. import progress as live
from ..errors import ModelError, QuantizeError
from ..families import Component, Family, family_info
from ..models.quiet import quiet_libraries
from .feeds import Call

RECIPE_SCHEMA = 1


@dataclass(frozen=True)
class CalibrationRecipe:
    """Everything that decides the calibration data (and so the scales). Its digest goes into keys."""

    prompts: tuple[str, ...]  # exactly the prompts run, in order; prompt i uses seed + i
    steps: int
    seed: int
    algorithm: str
    width: int
    height: int
    max_sequence_length: int | None = None  # T5 tokens (SD3, FLUX; Wan's UMT5): the engines' declared length
    frames: int | None = None  # a video family's frames (4k+1 for Wan); None for images
    # The folders of the ControlNets a UNet's engines take residuals from: every other prompt (1, 3, ...) runs with
    # one of them in turn, so the statistics see the residuals it adds (fed as zeros, they left the layers after each
    # addition calibrated without them, and an int8 UNet clipped what a ControlNet added). Empty: none.
    controlnets: tuple[str, ...] = ()

    @property
    def samples(self) -> int:
        return len(self.prompts)

    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.samples)]

    def controlnet_of(self, index: int) -> int | None:
        """The ControlNet (index into `controlnets`) prompt `index` runs with, or None: the odd prompts take them in
        turn, the even ones run without (a UNet's engines serve both)."""
        if not self.controlnets or index % 2 == 0:
            return None
        return (index // 2) % len(self.controlnets)

    def to_json(self) -> dict:
        fields = asdict(self)
        if fields["frames"] is None:  # an image recipe's JSON (and so its digest) is what it was before frames
            del fields["frames"]
        if not fields["controlnets"]:  # likewise a recipe without ControlNets
            del fields["controlnets"]
        else:
            fields["controlnets"] = list(self.controlnets)
        return {"schema": RECIPE_SCHEMA, **fields, "prompts": list(self.prompts)}

    @property
    def digest(self) -> str:
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()


def t5_length(model_dir: Path, family: Family) -> int | None:
    """The T5 token count the denoiser's engine inputs are declared with (components/model_config.py): the
    tokenizer's for SD3/FLUX, WanPipeline's max_sequence_length default for Wan (its UMT5 states are padded to
    it, and the transformer engines take exactly that many)."""
    from ..components.model_config import tokenizer_length

    info = family_info(family)
    if info.padded_text_length is not None:
        return info.padded_text_length  # padded to it, as the engines declare
    return tokenizer_length(model_dir, info.long_tokenizer) if info.long_tokenizer else None


def load_pipeline(model_dir: Path):
    """The real diffusers pipeline of the folder, fp32 on CPU, without progress bars."""
    import diffusers

    from ..models.loading import read_model_index

    quiet_libraries()
    read_model_index(model_dir)  # diffusers imports the module each entry names: check them first
    try:
        # safetensors only: a pickled .bin can run code when loaded (models.loading.require_safetensors)
        pipe = diffusers.DiffusionPipeline.from_pretrained(str(model_dir), dtype=torch.float32, use_safetensors=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the pipeline in {model_dir}: {str(exc).strip().splitlines()[0]}") from None
    pipe.set_progress_bar_config(disable=True)
    return pipe


def denoiser_of(pipe, component: Component | None = None) -> torch.nn.Module:
    """The pipeline's denoiser, or the one named (`transformer_2`: Wan 2.2's low-noise expert)."""
    if component is not None:
        module = getattr(pipe, component.value, None)
        if module is None:
            raise ModelError(f"{type(pipe).__name__} has no {component.value}")
        return module
    module = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    if module is None:
        raise ModelError(f"{type(pipe).__name__} has neither a unet nor a transformer")
    return module


def guidance_kwargs(family: Family, pipe=None) -> dict[str, Any]:
    """Pipeline defaults, written out so a diffusers upgrade cannot silently change the calibration data.

    Wan 2.2 (a `boundary_ratio` in the pipeline's config) also gets WanPipeline's guidance_scale_2 default, the
    high-noise scale; Wan 2.1 refuses the argument."""
    kwargs = dict(family_info(family).reference_guidance)  # the family's declaration
    # only WanPipeline's config has a boundary_ratio (a Wan 2.2 two-expert checkpoint)
    if getattr(getattr(pipe, "config", None), "boundary_ratio", None) is not None:
        kwargs = {**kwargs, "guidance_scale_2": kwargs["guidance_scale"]}
    return kwargs


class CallRecorder:
    """Forward pre-hook (and optional post-hook) that copies each call's inputs (and output)."""

    def __init__(self, with_outputs: bool = False, max_calls: int | None = None):
        self.calls: list[Call] = []
        self.outputs: list[torch.Tensor] = []
        self._with_outputs = with_outputs
        self._max_calls = max_calls  # the first calls only (an export's example inputs); None: every call
        self.seen = 0  # calls made, recorded or not
        # One copy per source tensor: the text embeddings repeat at every step. The source is kept alive so
        # its address cannot be reused by another tensor within the run.
        self._copies: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _copy(self, value: Any) -> Any:
        if torch.is_tensor(value):
            key = (value.data_ptr(), value._version, tuple(value.shape), tuple(value.stride()), value.dtype)
            if key not in self._copies:
                self._copies[key] = (value, value.detach().clone())
            return self._copies[key][1]
        if isinstance(value, dict):
            return {k: self._copy(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(v) for v in value)
        return value

    def _full(self) -> bool:
        return self._max_calls is not None and len(self.calls) >= self._max_calls

    def before(self, module, args, kwargs):
        self.seen += 1
        if not self._full():
            self.calls.append((self._copy(args), self._copy(kwargs)))

    def after(self, module, args, kwargs, output):
        if self._with_outputs and len(self.outputs) < len(self.calls):
            first = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
            if isinstance(first, (list, tuple)):  # a list of per-row outputs (Z-Image's transformer): stacked
                first = torch.stack(list(first))
            self.outputs.append(first.detach().clone())

    def new_run(self) -> None:
        self._copies.clear()  # tensors of a finished run may be freed and their memory reused


def controlnet_pipeline(pipe, folder: str):
    """The pipeline with the ControlNet in `folder` attached (diffusers' ControlNet form of the same pipeline,
    sharing its modules: the denoiser being calibrated is the one it calls)."""
    import diffusers

    try:
        controlnet = diffusers.ControlNetModel.from_pretrained(folder, dtype=torch.float32, use_safetensors=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the ControlNet in {folder}: {str(exc).strip().splitlines()[0]}") from None
    attached = diffusers.AutoPipelineForText2Image.from_pipe(pipe, controlnet=controlnet)
    attached.set_progress_bar_config(disable=True)
    return attached


def run_pipeline(pipe, family: Family, prompts: list[str] | tuple[str, ...], seeds: list[int], steps: int,
                 width: int, height: int, output_type: str = "latent", recorder: CallRecorder | None = None,
                 max_sequence_length: int | None = None, progress_stage: str = "generate",
                 frames: int | None = None, component: Component | None = None,
                 controlnet_of: Callable[[int], int | None] | None = None, controlnets: tuple[str, ...] = ()):
    """Generate each prompt with its own seeded generator; optionally record the calls of the denoiser
    (`component`, default the pipeline's first). `frames`: a video pipeline's num_frames; each result is then
    a clip [F, H, W, 3] (or its latents). `controlnets` (folders) with `controlnet_of(i)`: prompt i runs with that
    ControlNet over the synthetic edge map parity feeds (sample_inputs.control_image, seeded by the prompt's seed).

    Each prompt is a live progress line (`progress_stage` k/n)."""
    from PIL import Image

    from ..sample_inputs import control_image

    denoiser = denoiser_of(pipe, component)
    attached: dict[int, Any] = {}  # ControlNet index -> its pipeline, loaded when a prompt first runs with it
    handles = []
    if recorder is not None:
        handles.append(denoiser.register_forward_pre_hook(recorder.before, with_kwargs=True))
        handles.append(denoiser.register_forward_hook(recorder.after, with_kwargs=True))
    images = []
    size = f"{width}x{height}" + (f"x{frames}" if frames else "")
    try:
        with live.task(progress_stage, total=len(prompts), detail=f"{size}, {steps} steps") as lines:
            for index, (prompt, seed) in enumerate(zip(prompts, seeds)):
                lines.step(index + 1, f"seed {seed}, {steps} steps at {size}")
                if recorder is not None:
                    recorder.new_run()
                generator = torch.Generator("cpu").manual_seed(seed)
                extra = guidance_kwargs(family, pipe)
                if max_sequence_length is not None:
                    extra["max_sequence_length"] = max_sequence_length
                if frames:
                    extra["num_frames"] = frames
                runs = pipe
                if controlnets and (which := controlnet_of(index)) is not None:
                    if which not in attached:
                        attached[which] = controlnet_pipeline(pipe, controlnets[which])
                    runs = attached[which]
                    extra["image"] = Image.fromarray(control_image(height, width, seed))
                with torch.no_grad():
                    # by name: Flux2Pipeline's first parameter is the reference image
                    result = runs(prompt=prompt, num_inference_steps=steps, generator=generator, width=width, height=height,
                                  output_type=output_type, **extra)
                if output_type == "latent":
                    images.append(None)
                else:  # a video pipeline's output holds `frames` (clips), an image pipeline's `images`
                    images.append(result.frames[0] if frames else result.images[0])
    except (RuntimeError, ValueError) as exc:
        raise QuantizeError(f"the {family.value} pipeline failed while generating calibration data "
                            f"at {size}: {str(exc).strip().splitlines()[0]}") from exc
    finally:
        for handle in handles:
            handle.remove()
    return images


def capture_calls(pipe, family: Family, recipe: CalibrationRecipe, component: Component | None = None) -> list[Call]:
    """The denoiser calls of the recipe (samples x steps of them; an expert's share of the steps), in order."""
    recorder = CallRecorder()
    run_pipeline(pipe, family, recipe.prompts, recipe.seeds(), recipe.steps, recipe.width, recipe.height,
                 recorder=recorder, max_sequence_length=recipe.max_sequence_length, progress_stage="calibration data",
                 frames=recipe.frames, component=component, controlnet_of=recipe.controlnet_of,
                 controlnets=recipe.controlnets)
    if not recorder.calls:
        raise QuantizeError("the pipeline never called the denoiser during calibration")
    return recorder.calls


def calibration_loop(pipe, family: Family, recipe: CalibrationRecipe,
                     component: Component | None = None) -> tuple[Callable[[torch.nn.Module], None], CallRecorder]:
    """A ModelOpt forward loop that runs the recipe's generations through `pipe`, and the recorder that holds
    the first denoiser call (the export trace's example inputs) and counts the calls once the loop has run.

    The module ModelOpt hands the loop must be the pipeline's own denoiser (quantized in place), or the
    statistics would be taken on a module the generations never call. `component` names it where a pipeline has
    two (Wan 2.2's `transformer_2` sees the low-noise steps only; the other expert runs in fp32 meanwhile).
    """
    recorder = CallRecorder(max_calls=1)

    def forward_loop(module: torch.nn.Module) -> None:
        if module is not denoiser_of(pipe, component):
            raise RuntimeError("the calibration loop runs the pipeline's own denoiser, not a copy of it")
        run_pipeline(pipe, family, recipe.prompts, recipe.seeds(), recipe.steps, recipe.width, recipe.height,
                     recorder=recorder, max_sequence_length=recipe.max_sequence_length,
                     progress_stage="calibration", frames=recipe.frames, component=component,
                     controlnet_of=recipe.controlnet_of, controlnets=recipe.controlnets)
        if not recorder.calls:
            raise QuantizeError("the pipeline never called the denoiser during calibration")

    return forward_loop, recorder

