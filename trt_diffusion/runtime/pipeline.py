"""One pipeline over runners (the hub): validation, batching by `batch_key`, and the family's loop
(`FamilyLoop`, runtime/family_loops.py: encode → denoise → decode), which its declaration names — the UNet/SD3 loop
(runtime/unet_loop.py), FLUX.1's (flux_loop.py: packed latents, Fill, Kontext edit), Wan video's (video_loop.py),
Qwen-Image's (qwen_image_loop.py: true CFG, variable text lengths), FLUX.2's, Z-Image's. The hub keeps what several
loops share: the CLIP/T5 prompt encoding by the declaration's `text_encoding` and the image VAE decode. The loops
follow diffusers' pipelines step for step, so the torch-reference runners reproduce diffusers' images exactly and
engine runners can be compared to them.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..components.model_config import vae_latent_channels, vae_scale_factor
from ..engines_file.engine_spec import Size
from ..engines_file.schema import CfgMode
from ..errors import InternalError, RuntimeInputError
from ..families import EditKind, Family, TextEncoding, family_info
from ..step_cache import PIECES, StepCache, StepCacheMethod, StepCacheMode
from ..workflows import (
    EDIT_PIPELINE_CLASSES,
    FAMILY_WORKFLOWS,
    IMAGE_TO_VIDEO_PIPELINE_CLASSES,
    Workflow,
    edit_pipeline_classes,
)
from . import conditioning
from .cfg_parallel import cfg_modes
from .engines import MAX_DYNAMIC_ROWS, RunnerTable
from .family_loops import FamilyLoop, family_loop
from .flux2_loop import Flux2Loop
from .flux_loop import FluxLoop
from .qwen_image_loop import QwenImageLoop, qwen_edit_image_problems, qwen_problems
from .requests import (  # re-exported: the request types' importers know them from here
    Conditioning,  # noqa: F401 - re-exported (triton/backend/pipeline_model.py)
    Generation,
    GenerationRequest,
    PromptEncoding,
    StageTimings,
    StepCallback,
    _Conditioning,
    input_problems,
)
from .schedulers import scheduler_names
from .unet_loop import latent_device
from .video_loop import WanLoop, video_problems

MAX_STEPS = 1000
MAX_PROMPT_CHARS = 4096  # PROMPT and NEGATIVE_PROMPT (the Triton models also cap their bytes before decoding)
MAX_CONTROLNET_SCALE = 100.0


def _tokenizer(model_dir: Path, subfolder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir / subfolder)


class EnginePipeline:
    """Runs requests over a RunnerTable. Holds no per-request state: safe to share between threads.

    `cfg`: engines.yaml's CFG modes for the model (package records them for the Triton entry). They matter only
    for `parallel`, which is never guessed: split's two calls issued at once on two instances of the denoiser
    (runtime/cfg_parallel.py), wherever the engines at the request's rows exist. Without it the mode follows
    from the engine batches built, as before (`_cfg_mode`).

    `text_lengths`: Qwen-Image's engines' (min, opt, max) prompt tokens (engines.yaml's `text_length`); None: the
    family's default range."""

    def __init__(self, model_dir: str | Path, family: Family | str, runners: RunnerTable,
                 workflows: tuple[Workflow | str, ...] | None = None, cfg: tuple[CfgMode | str, ...] | None = None,
                 text_lengths: tuple[int, int, int] | None = None, step_cache: StepCache | None = None):
        from ..models.loading import read_model_index
        from ..models.quiet import quiet_libraries

        quiet_libraries()
        self.model_dir = Path(model_dir)
        self.family = Family(family)
        self.runners = runners
        self.cfg = cfg_modes(cfg)
        self.parallel_cfg = CfgMode.parallel in self.cfg
        # every entry checked to name a diffusers or transformers class: the family loops hand entries on (a Wan
        # image-to-video folder's image_processor is imported by the class it names)
        self.index = read_model_index(self.model_dir)
        self.scheduler_config = json.loads((self.model_dir / "scheduler" / "scheduler_config.json").read_text())
        vae_config = self.vae_config = json.loads((self.model_dir / "vae" / "config.json").read_text())
        self.text_lengths = text_lengths
        self.vae_scale_factor = vae_scale_factor(vae_config)
        self.scaling_factor = vae_config.get("scaling_factor", 0.18215)
        self.shift_factor = vae_config.get("shift_factor") or 0.0
        info = family_info(self.family)
        denoiser = info.denoiser.value
        self.denoiser = denoiser
        self.text_encoding = info.text_encoding  # the CLIP/T5 prompt encoding (the UNet/SD3 loop's, FLUX.1's)
        self.denoiser_config = json.loads((self.model_dir / denoiser / "config.json").read_text())
        self.tokenizers = {name: _tokenizer(self.model_dir, name) for name in
                           ("tokenizer", "tokenizer_2", "tokenizer_3") if self.index.get(name, [None])[0]}
        self.latent_channels = vae_latent_channels(vae_config)
        # the loop the family's declaration names (runtime/family_loops.py; SD1.5/SDXL/SD3: runtime/unet_loop.py)
        self.loop: FamilyLoop = family_loop(self)
        self.workflows = tuple(Workflow(w) for w in workflows) if workflows else self._served_workflows()
        # engines.yaml's step cache; a pipeline without its pieces' runners (the torch reference) runs every step whole
        self.step_cache = step_cache if step_cache is not None and all(
            runners.has(piece) for piece in PIECES[step_cache.method]) else None

    @contextlib.contextmanager
    def runners_swapped(self, runners: RunnerTable):
        """Run with `runners` in place of the pipeline's own, the family loops' included (the Triton entry's
        python warm-up runs on stand-ins this way), and put the own ones back after."""
        own = self.runners
        self.runners = runners
        self.loop.runners = runners
        try:
            yield
        finally:
            self.runners = own
            self.loop.runners = own

    def _loop_of(self, kind: type):
        """The family loop's computation where it is a `kind` (the problems functions take it or None)."""
        inner = getattr(self.loop, "inner", None)
        return inner if isinstance(inner, kind) else None

    # the family loops under their old names (tests and the Triton entry read them); None for other families
    flux = property(lambda self: self._loop_of(FluxLoop))
    wan = property(lambda self: self._loop_of(WanLoop))
    qwen = property(lambda self: self._loop_of(QwenImageLoop))
    flux2 = property(lambda self: self._loop_of(Flux2Loop))

    def _served_workflows(self) -> tuple[Workflow, ...]:
        """What the runners can serve when the caller does not say (engines.yaml's `workflows` does): an
        inpainting denoiser (mask and masked-image channels) serves inpaint only; image workflows need the VAE
        encoder; edit needs an edit checkpoint, img2vid an image-to-video one (which serves img2vid alone) and,
        for Wan 2.1 I2V, the CLIP image encoder too."""
        possible = FAMILY_WORKFLOWS[self.family]
        if self._inpainting_denoiser:
            possible = (Workflow.inpaint,)
        checkpoint = self.index.get("_class_name")
        for workflow, classes in ((Workflow.edit, EDIT_PIPELINE_CLASSES),
                                  (Workflow.img2vid, IMAGE_TO_VIDEO_PIPELINE_CLASSES)):
            possible = tuple(w for w in possible if (w is workflow) == (checkpoint in classes))
        if not self.runners.has("vae_encoder"):
            possible = tuple(w for w in possible if not w.needs_image)
        if self._img2vid_runners_missing():
            possible = tuple(w for w in possible if w is not Workflow.img2vid)
        return possible

    @property
    def _inpainting_denoiser(self) -> bool:
        if self.index.get("_class_name") in IMAGE_TO_VIDEO_PIPELINE_CLASSES:
            return False  # its extra channels are the first-frame mask and the image's clip latents
        channels = self.denoiser_config["in_channels"]
        if family_info(self.family).packed_latents:
            channels //= 4  # packed 2x2 patches
        return channels > self.latent_channels

    # ---------------------------------------------------------------- public

    def validate(self, request: GenerationRequest) -> Size:
        size = Size(request.width, request.height, request.frames)  # a video's frames pick its bucket too
        factor = self.vae_scale_factor * (1 if self.denoiser == "unet" else 2)  # the DiTs patchify 2x2 latents
        problems = []
        if not isinstance(request.prompt, str) or not request.prompt.strip():
            problems.append("PROMPT is empty")
        elif len(request.prompt) > MAX_PROMPT_CHARS:
            problems.append(f"PROMPT has {len(request.prompt)} characters (at most {MAX_PROMPT_CHARS}; "
                            "the text encoders read only the first 77 tokens anyway)")
        if request.negative_prompt is not None and (not isinstance(request.negative_prompt, str)
                                                    or len(request.negative_prompt) > MAX_PROMPT_CHARS):
            length = len(request.negative_prompt) if isinstance(request.negative_prompt, str) else "?"
            problems.append(f"NEGATIVE_PROMPT has {length} characters (at most {MAX_PROMPT_CHARS})")
        if not 1 <= request.steps <= MAX_STEPS:
            problems.append(f"STEPS must be between 1 and {MAX_STEPS}, got {request.steps}")
        if request.width % factor or request.height % factor or request.width <= 0 or request.height <= 0:
            problems.append(f"size {size} is not a positive multiple of {factor}")
        if request.batch < 1:
            problems.append(f"batch must be >= 1, got {request.batch}")
        if not np.isfinite(request.guidance_scale) or not 0 <= request.guidance_scale <= 100:
            problems.append(f"GUIDANCE_SCALE must be in [0, 100], got {request.guidance_scale}")
        if not np.isfinite(request.controlnet_scale) or not 0 <= request.controlnet_scale <= MAX_CONTROLNET_SCALE:
            problems.append(f"CONTROLNET_SCALE must be in [0, {MAX_CONTROLNET_SCALE}], got {request.controlnet_scale}")
        if request.scheduler not in scheduler_names(self.family.value):
            problems.append(f"unknown scheduler {request.scheduler!r}; choose one of "
                            f"{', '.join(scheduler_names(self.family.value))}")
        if request.controlnet is not None:
            if not self.runners.has("controlnet", request.controlnet):
                served = sorted({e.controlnet for e in self.runners.entries if e.controlnet})
                problems.append(f"no ControlNet named {request.controlnet!r} is served (served: "
                                f"{', '.join(served) or 'none: this pipeline has no ControlNet'})")
            if request.control_image is None:
                problems.append("a ControlNet request needs CONTROL_IMAGE")
            elif request.control_image.shape != (request.height, request.width, 3):
                problems.append(f"CONTROL_IMAGE is {list(request.control_image.shape)}, expected "
                                f"[{request.height}, {request.width}, 3]")
        if request.step_cache is not None and request.step_cache not in {m.value for m in StepCacheMode}:
            problems.append(f"STEP_CACHE must be 'on' or 'off', got {request.step_cache!r}")
        problems += self._image_problems(request)
        problems += video_problems(self.family, request, self._loop_of(WanLoop))
        problems += qwen_problems(request, self._loop_of(QwenImageLoop))
        problems += input_problems(family_info(self.family).request_inputs, request)  # the family's own inputs
        if problems:
            raise RuntimeInputError("; ".join(problems))
        supported = self.runners.supported_sizes(self.denoiser)
        if supported and not any(e.bucket is None or e.bucket.covers(size)
                                 for e in self.runners.entries if e.component == self.denoiser):
            raise RuntimeInputError(f"size {size} is not served; supported sizes: {', '.join(supported)}")
        return size

    def _image_problems(self, request: GenerationRequest) -> list[str]:
        """The image-conditioned inputs against the workflow they ask for and what this pipeline serves."""
        try:
            workflow = request.resolved_workflow
        except ValueError as err:
            return [str(err)]
        problems = []
        served = ", ".join(w.value for w in self.workflows)
        missing = self._img2vid_runners_missing() if workflow is Workflow.img2vid else None
        if workflow not in self.workflows:
            checkpoint = self.index.get("_class_name")
            if workflow not in FAMILY_WORKFLOWS[self.family]:
                why = f"the {self.family.value} family has no {workflow.value} workflow"
            elif workflow is Workflow.edit and checkpoint not in EDIT_PIPELINE_CLASSES:
                why = (f"edit needs an edit checkpoint ({', '.join(edit_pipeline_classes(checkpoint))}), this one is "
                       f"{checkpoint}")
            elif workflow is Workflow.img2vid and checkpoint not in IMAGE_TO_VIDEO_PIPELINE_CLASSES:
                why = (f"img2vid needs an image-to-video checkpoint ({', '.join(IMAGE_TO_VIDEO_PIPELINE_CLASSES)}), "
                       f"this one is {checkpoint}, whose transformer takes no image")
            elif checkpoint in IMAGE_TO_VIDEO_PIPELINE_CLASSES and workflow is not Workflow.img2vid:
                why = (f"this {checkpoint} checkpoint makes a clip from its first frame (its transformer takes the "
                       f"image's latents beside the noise): give INIT_IMAGE")
            elif missing:
                why = missing
            else:
                why = "it is not in this model's workflows"
            given = " (a MASK asks for inpaint)" if request.mask is not None and not request.workflow else ""
            problems.append(f"WORKFLOW {workflow.value}{given} is not served: {why} (served: {served})")
        elif missing:  # declared in engines.yaml, without the encoders it runs
            problems.append(f"WORKFLOW img2vid is not served: {missing}")
        if request.mask is not None and request.init_image is None:
            problems.append("a MASK needs the INIT_IMAGE it masks")
        if workflow.needs_image and request.init_image is None:
            problems.append(f"WORKFLOW {workflow.value} needs INIT_IMAGE")
        if not workflow.needs_image and request.init_image is not None:
            problems.append(f"WORKFLOW {workflow.value} takes no INIT_IMAGE")
        if workflow.needs_mask and request.mask is None and request.init_image is not None:
            problems.append("WORKFLOW inpaint needs MASK")
        if not workflow.needs_mask and request.mask is not None:
            hint = " (inpaint does)" if Workflow.inpaint in FAMILY_WORKFLOWS[self.family] else ""
            problems.append(f"WORKFLOW {workflow.value} takes no MASK{hint}")
        expected = (request.height, request.width)
        for name, value, shape in (("INIT_IMAGE", request.init_image, expected + (3,)),
                                   ("MASK", request.mask, expected)):
            if value is None:
                continue
            if not isinstance(value, np.ndarray) or value.dtype != np.uint8:
                problems.append(f"{name} must be uint8")
            elif (family_info(self.family).edit is EditKind.vision_reference and workflow is Workflow.edit
                  and name == "INIT_IMAGE"):
                problems += qwen_edit_image_problems(value, request)  # resized by the pipeline, at its aspect
            elif value.shape != shape:
                problems.append(f"{name} is {list(value.shape)}, expected {list(shape)} (the request's size; "
                                "images are not resized)")
        if request.strength is not None:
            if not workflow.takes_strength:
                problems.append(f"WORKFLOW {workflow.value} takes no STRENGTH")
            elif not np.isfinite(request.strength) or not 0 < request.strength <= 1:
                problems.append(f"STRENGTH must be in (0, 1], got {request.strength}")
            elif 1 <= request.steps <= MAX_STEPS and conditioning.kept_steps(
                    request.steps, request.strength, self.family) < 1:
                problems.append(f"STRENGTH {request.strength} keeps no step of {request.steps}: raise STEPS "
                                "or STRENGTH")
        return problems

    def _img2vid_runners_missing(self) -> str | None:
        """Why an image-to-video checkpoint's img2vid cannot run here, where an encoder it needs is not served."""
        image = getattr(self.loop, "image_condition", None)
        missing = [] if image is None else [c for c in image.components if not self.runners.has(c)]
        if not missing:
            return None
        return f"it runs {' and '.join(image.components)} on INIT_IMAGE, but no {' or '.join(missing)} runner is served"

    def cache_interval(self, request: GenerationRequest) -> int | None:
        """DeepCache's interval where the request runs cached (a full UNet step every `interval` steps of the
        schedule it runs, `step_cache.deepcache_full_steps`); None: every step whole, on the uncached engine. The
        request's STEP_CACHE decides, engines.yaml's `step_cache.enabled` where it sends none."""
        cache = self.step_cache
        if cache is None or cache.method is not StepCacheMethod.deepcache or not self._cache_on(request):
            return None
        return cache.interval

    def cache_threshold(self, request: GenerationRequest) -> float | None:
        """first_block's threshold where the request runs cached (FLUX); None: every step whole."""
        cache = self.step_cache
        if cache is None or cache.method is not StepCacheMethod.first_block or not self._cache_on(request):
            return None
        return cache.threshold

    def _cache_on(self, request: GenerationRequest) -> bool:
        wanted = request.step_cache
        if wanted is None:
            wanted = StepCacheMode.on.value if self.step_cache.enabled else StepCacheMode.off.value
        return wanted == StepCacheMode.on.value

    def generate(self, request: GenerationRequest, on_step: StepCallback | None = None) -> Generation:
        size = self.validate(request)
        timings = StageTimings()
        start = time.perf_counter()
        encoding = self.encode(request)
        timings.text_encode_s = time.perf_counter() - start
        latents, cfg_mode = self.denoise(request, encoding, timings, on_step)
        start = time.perf_counter()
        images = self.decode(latents, size, request.batch)
        timings.vae_decode_s = time.perf_counter() - start
        return Generation(images, timings, cfg_mode)

    # ---------------------------------------------------------------- batches of requests

    def batch_key(self, request: GenerationRequest) -> tuple:
        """Requests with equal keys can share denoiser calls: same latent shape, step count and scheduler
        (so the same timesteps), CFG on or off, same ControlNet and scale (one conditioning_scale per call).
        Prompts, negative prompts, seeds and guidance scales are each request's own."""
        cfg = self._runs_cfg(request)
        controlnet = (request.controlnet, request.controlnet_scale) if request.controlnet else None
        workflow = request.resolved_workflow  # the same trimmed schedule and denoiser inputs
        strength = request.resolved_strength if workflow.takes_strength else None
        key = (request.width, request.height, request.steps, request.scheduler, cfg, controlnet, workflow, strength,
               tuple(request.loras),  # the engines hold one LoRA set per call
               tuple(sorted(request.inputs.items())))  # the family's own inputs (Z-Image's CFG): one per call
        # a cached request shares calls only with requests of the same schedule (steps and strength are in the key)
        key += (self.cache_interval(request),)
        if not self.loop.batches_requests:
            # one request per batch (the family loops say why)
            key += (id(request),)
        return key

    def _runs_cfg(self, request: GenerationRequest) -> bool:
        """Whether the request's denoiser runs twice per step: FLUX.1 and FLUX.2 dev embed guidance (never)."""
        return self.loop.runs_cfg(request)

    def batch_rows(self, request: GenerationRequest) -> set[int] | None:
        """Row counts (sums of requests' `batch`) a batch like `request` can run with, in the CFG mode the request
        alone would use (so a batched row is computed as the unbatched one); None: any up to MAX_DYNAMIC_ROWS."""
        size = Size(request.width, request.height, request.frames)
        batches = self.runners.batches(self.denoiser, size)
        if None in batches:
            return None
        cfg = self._runs_cfg(request)
        if not cfg:  # any rows up to the largest engine batch: fewer are padded (runtime/engines.py)
            return set(range(1, max(b for b in batches if b) + 1)) if any(batches) else set()
        parallel = self.parallel_cfg and request.batch in batches  # split's engines, as `_cfg_mode` chooses
        if 2 * request.batch in batches and not parallel:  # batched CFG, as the request alone
            return {b // 2 for b in batches if b and b % 2 == 0}
        return {b for b in batches if b}  # split (or parallel) CFG

    def plan_batches(self, requests: list[GenerationRequest]
                     ) -> tuple[dict[int, RuntimeInputError], list[list[int]]]:
        """(errors by index, batches of indices). A request that fails validation is answered alone; the others are
        grouped by `batch_key` and each group split over the engine batches there are (3 = 2 + 1)."""
        errors: dict[int, RuntimeInputError] = {}
        groups: dict[tuple, list[int]] = {}
        for index, request in enumerate(requests):
            try:
                self.validate(request)
            except RuntimeInputError as err:
                errors[index] = err
                continue
            groups.setdefault(self.batch_key(request), []).append(index)
        batches = []
        for indices in groups.values():
            feasible = self.batch_rows(requests[indices[0]])
            batches += _split_rows([requests[i].batch for i in indices], feasible, indices)
        return errors, batches

    def generate_batch(self, requests: list[GenerationRequest], on_step: StepCallback | None = None
                       ) -> list[Generation | RuntimeInputError]:
        """Each request's Generation (or its RuntimeInputError), running requests that share a `batch_key` through
        one denoiser call per step. Every image equals the one `generate` gives the request alone: each request
        keeps its own generator, scheduler, prompts and guidance; only the engine calls are shared."""
        errors, batches = self.plan_batches(requests)
        results: list = [errors.get(i) for i in range(len(requests))]
        start = time.perf_counter()
        for indices in batches:
            wait = time.perf_counter() - start
            for index, generation in zip(indices, self.generate_together([requests[i] for i in indices], on_step)):
                generation.timings.wait_s = wait
                results[index] = generation
        return results

    def generate_together(self, requests: list[GenerationRequest], on_step: StepCallback | None = None
                          ) -> list[Generation]:
        """One batch of `plan_batches`: requests of one `batch_key` whose rows an engine batch serves."""
        if len(requests) == 1 or not self.loop.batches_requests:
            return [self.generate(r, on_step) for r in requests]
        size = self.validate(requests[0])
        timings = [StageTimings(batch=len(requests)) for _ in requests]
        encodings = []
        for request, timing in zip(requests, timings):
            start = time.perf_counter()
            encodings.append(self.encode(request))
            timing.text_encode_s = time.perf_counter() - start
        steps = StageTimings()
        latents, cfg_mode = self.loop.denoise_together(requests, encodings, size, steps, on_step)
        generations = []
        for request, timing, latent in zip(requests, timings, latents):
            timing.step_s = list(steps.step_s)
            start = time.perf_counter()
            images = self.decode(latent, size, request.batch)
            timing.vae_decode_s = time.perf_counter() - start
            generations.append(Generation(images, timing, cfg_mode))
        return generations

    def encode(self, request: GenerationRequest) -> PromptEncoding:
        """Text encoders for the prompt (and the negative prompt where CFG runs)."""
        return self.loop.encode(request)

    def denoise(self, request: GenerationRequest, encoding: PromptEncoding,
                timings: StageTimings | None = None, on_step: StepCallback | None = None
                ) -> tuple[torch.Tensor, str]:
        """The scheduler loop from seeded noise to final latents, with a fresh scheduler for this request."""
        size = Size(request.width, request.height)
        timings = timings or StageTimings()
        return self.loop.denoise(request, encoding, size, timings, on_step, self.cache_threshold(request))

    # ---------------------------------------------------------------- text (CLIP/T5: the UNet/SD3 loop's, FLUX.1's)

    def _ids(self, tokenizer_name: str, prompts: list[str], max_length: int | None = None) -> np.ndarray:
        tokenizer = self.tokenizers[tokenizer_name]
        return tokenizer(prompts, padding="max_length", max_length=max_length or tokenizer.model_max_length,
                         truncation=True, return_tensors="np").input_ids.astype(np.int64)

    def _encode(self, component: str, tokenizer_name: str, prompts: list[str]) -> dict[str, np.ndarray]:
        ids = self._ids(tokenizer_name, prompts)
        runner = self.runners.find(component, size=None, batch=len(prompts))
        return runner.run({"input_ids": ids})

    def _encode_all(self, prompts: list[str]) -> _Conditioning:
        """The prompts' encoding as the family's declaration says (`FamilyInfo.text_encoding`)."""
        encoding = self.text_encoding
        if encoding is TextEncoding.clip:
            return _Conditioning(self._encode("text_encoder", "tokenizer", prompts)["hidden_states"])
        if encoding is TextEncoding.clip_pair:
            one = self._encode("text_encoder", "tokenizer", prompts)
            two = self._encode("text_encoder_2", "tokenizer_2", prompts)
            return _Conditioning(np.concatenate([one["hidden_states"], two["hidden_states"]], -1), two["pooled"])
        if encoding is TextEncoding.clip_pair_t5:
            one = self._encode("text_encoder", "tokenizer", prompts)
            two = self._encode("text_encoder_2", "tokenizer_2", prompts)
            clip = np.concatenate([one["hidden_states"], two["hidden_states"]], -1)
            if self.runners.has("text_encoder_3"):
                t5 = self._encode("text_encoder_3", "tokenizer_3", prompts)["hidden_states"]
            else:  # SD3 without T5: zeros, as diffusers does
                t5 = np.zeros((len(prompts), self.tokenizers["tokenizer"].model_max_length,
                               self.denoiser_config["joint_attention_dim"]), np.float32)
            clip = np.pad(clip, ((0, 0), (0, 0), (0, t5.shape[-1] - clip.shape[-1])))
            return _Conditioning(np.concatenate([clip, t5], -2), np.concatenate([one["pooled"], two["pooled"]], -1))
        if encoding is not TextEncoding.clip_t5:
            raise InternalError(f"the {self.family.value} family declares no CLIP/T5 prompt encoding")
        clip = self._encode("text_encoder", "tokenizer", prompts)
        t5 = self._encode("text_encoder_2", "tokenizer_2", prompts)
        return _Conditioning(t5["hidden_states"], clip["pooled"])

    def _latent_device(self, request: GenerationRequest) -> str | None:
        """Where the UNet/SD3 loop keeps the request's latents between steps (runtime/unet_loop.latent_device)."""
        return latent_device(self.runners, self.denoiser, request)

    def _cfg_mode(self, size: Size, batch: int) -> str:
        batches = self.runners.batches(self.denoiser, size)
        if self.parallel_cfg and (None in batches or batch in batches):  # declared: wherever split could run
            return "parallel"
        if None in batches or 2 * batch in batches:
            return "batched"
        if batch in batches:
            return "split"
        raise RuntimeInputError(f"no {self.denoiser} engine at {size} for batch {batch} with CFG "
                                f"(needs batch {2 * batch} or {batch}); built: {sorted(b for b in batches if b)}")

    # ---------------------------------------------------------------- VAE

    def decode(self, latents: torch.Tensor, size: Size, batch: int) -> np.ndarray:
        """Latents to uint8 images [B, H, W, 3] (a video family's [B, F, H, W, 3])."""
        return _uint8(self.loop.decode(latents, size, batch))

    def _decode_vae(self, latents: torch.Tensor, size: Size, batch: int) -> np.ndarray:
        """The image VAE decoder's pixels in [-1, 1] (the UNet/SD3 loop's, FLUX.1's and Z-Image's)."""
        latents = latents / self.scaling_factor + self.shift_factor
        runner = self.runners.find("vae_decoder", size=size, batch=batch)
        return runner.run({"latent": latents.float().numpy()})["images"]  # layout kept, as in _denoise


def _uint8(pixels: np.ndarray) -> np.ndarray:
    """A VAE's [-1, 1] pixels, channels on axis 1 ([B, 3, H, W] or a video's [B, 3, F, H, W]), as uint8 with the
    channels last: diffusers' postprocess (denormalize x/2 + 0.5 clamped to [0, 1]; VideoProcessor per frame) and
    its uint8 rounding, round(x * 255)."""
    pixels = np.clip(pixels / 2 + 0.5, 0.0, 1.0)
    return (np.moveaxis(pixels, 1, -1) * 255).round().astype(np.uint8)


def _split_rows(rows: list[int], feasible: set[int] | None, indices: list[int]) -> list[list[int]]:
    """Split requests (their row counts, in order) into runs whose row sums an engine batch serves, the largest
    first: rows [1, 1, 1] over feasible {1, 2} -> [[a, b], [c]]. A request no run can take goes alone (and fails
    alone with the pipeline's own message)."""
    limit = MAX_DYNAMIC_ROWS if feasible is None else max(feasible, default=0)
    ok = (lambda n: 1 <= n <= MAX_DYNAMIC_ROWS) if feasible is None else (lambda n: n in feasible)
    batches, pending = [], list(zip(indices, rows))
    while pending:
        taken, total = [], 0
        for index, count in pending:  # the longest prefix within the largest batch...
            if total + count > limit:
                break
            taken.append((index, count))
            total += count
        while taken and not ok(total):  # ...shortened until an engine serves its rows
            total -= taken.pop()[1]
        if not taken:
            taken = [pending[0]]
        batches.append([index for index, _ in taken])
        pending = pending[len(taken):]
    return batches
