"""The vocabulary a family's declaration is written in: family and component names, kinds of guidance and of edit,
the precision defaults a component may declare, and `FamilyInfo`, the declaration itself.

Pure data, no torch: the spec layer validates engines.yaml against it; code a family needs (its denoise loop) is
named lazily as `"module:Class"`, the way target_registry names targets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from ..precision import Precision


class Family(str, Enum):
    __str__ = str.__str__  # str() and f-strings give the value ("sd15"), as the plain strings specs held did

    sd15 = "sd15"
    sdxl = "sdxl"
    sd3 = "sd3"
    flux = "flux"
    wan = "wan"  # Wan 2.1 / 2.2 video (text-to-video; image-to-video checkpoints)
    qwen_image = "qwen_image"  # Qwen-Image: a Qwen2.5-VL language-model encoder, an MMDiT, a Wan-style 3D VAE
    flux2 = "flux2"  # FLUX.2 dev: a Mistral-3 language-model encoder, embedded guidance (one call per step)
    flux2_klein = "flux2_klein"  # FLUX.2 Klein: a Qwen3 encoder, true CFG (two calls per step)
    z_image = "z_image"  # Z-Image and Z-Image-Turbo: a Qwen3 encoder, a single-stream DiT over unpadded prompts


class Component(str, Enum):
    __str__ = str.__str__

    text_encoder = "text_encoder"
    text_encoder_2 = "text_encoder_2"
    text_encoder_3 = "text_encoder_3"
    unet = "unet"
    transformer = "transformer"
    transformer_2 = "transformer_2"  # Wan 2.2's low-noise expert (model_index.json's boundary_ratio switches to it)
    image_encoder = "image_encoder"  # Wan 2.1 image-to-video's CLIP vision encoder; Qwen-Image-Edit's Qwen2.5-VL one
    vae_encoder = "vae_encoder"
    vae_decoder = "vae_decoder"
    controlnet = "controlnet"

    @property
    def is_denoiser(self) -> bool:
        return self in (Component.unet, Component.transformer, Component.transformer_2)

    @property
    def is_text_encoder(self) -> bool:
        return self.value.startswith("text_encoder")

    @property
    def is_vae(self) -> bool:
        return self in (Component.vae_encoder, Component.vae_decoder)


# The folder of a diffusers pipeline that holds each component (ControlNets have their own source).
SUBFOLDER = {
    Component.text_encoder: "text_encoder",
    Component.text_encoder_2: "text_encoder_2",
    Component.text_encoder_3: "text_encoder_3",
    Component.unet: "unet",
    Component.transformer: "transformer",
    Component.transformer_2: "transformer_2",
    Component.image_encoder: "image_encoder",
    Component.vae_encoder: "vae",
    Component.vae_decoder: "vae",
}


class CfgKind(str, Enum):
    """How a family's pipeline runs guidance, from which engines.yaml's default `cfg` (and so the denoiser's batch
    shapes) follows."""

    __str__ = str.__str__

    batched = "batched"  # classic CFG: the prompt's and the negative prompt's rows in one call (or in two)
    true_cfg = "true_cfg"  # two calls per step, each over the request's rows, as diffusers makes them: split only
    embedded = "embedded"  # guidance is an input of the denoiser: one call per step over the request's rows

    @property
    def default_cfg(self) -> tuple[str, ...]:
        """engines.yaml's `cfg` where the file leaves it out (CfgMode values: engines_file is a floor above)."""
        return {CfgKind.batched: ("batched",), CfgKind.true_cfg: ("split",), CfgKind.embedded: ("none",)}[self]

    @property
    def words(self) -> str:
        return {CfgKind.batched: "classifier-free guidance",
                CfgKind.true_cfg: "true CFG (the prompt's call, then the negative prompt's, each over the request's rows)",
                CfgKind.embedded: "embedded guidance (one call per step)"}[self]

    @property
    def serving_cfg(self) -> frozenset[str]:
        """The `cfg` modes whose engines the family's requests run (true CFG: never batched's twice-the-rows ones)."""
        if self is CfgKind.true_cfg:
            return frozenset(("split", "parallel", "none"))
        return frozenset(("batched", "split", "parallel", "none"))


class EditKind(str, Enum):
    """How a family's edit workflow gives the denoiser the reference image."""

    __str__ = str.__str__

    # FLUX.1 Kontext: the init image's latent tokens beside the noise tokens (twice the image-token sequence)
    context_tokens = "context_tokens"
    # Qwen-Image-Edit: the reference at about 1024² of the bucket's aspect, through a vision tower (image_encoder)
    # into the prompt's tokens, and its latents beside the noise tokens; the graphs fix its grid per bucket
    vision_reference = "vision_reference"


class TextEncoding(str, Enum):
    """How the UNet/SD3 loop (runtime/unet_loop.py) and FLUX.1's encode a prompt from CLIP and T5 encoder engines (the
    hub's `_encode_all`, runtime/pipeline.py)."""

    __str__ = str.__str__

    clip = "clip"  # one CLIP's hidden states, no pooled embedding (SD1.5)
    # two CLIPs' hidden states side by side and the second's pooled embedding, which the UNet takes as
    # `text_embeds` beside the size ids (`time_ids`: diffusers' addition_embed_type "text_time"); an empty negative
    # prompt is zeros where model_index.json's force_zeros_for_empty_prompt says (its default: true) (SDXL)
    clip_pair = "clip_pair"
    # two CLIPs' hidden states side by side, padded to T5's width and followed by T5's along the sequence (zeros
    # without a text_encoder_3 engine, as diffusers does); both CLIPs' pooled embeddings side by side (SD3)
    clip_pair_t5 = "clip_pair_t5"
    clip_t5 = "clip_t5"  # T5's hidden states and CLIP's pooled embedding (FLUX.1)

    @property
    def text_time(self) -> bool:
        """The UNet takes the pooled embedding (`text_embeds`) and the size ids (`time_ids`) beside the states."""
        return self is TextEncoding.clip_pair

    @property
    def zeros_for_empty_negative(self) -> bool:
        """An absent negative prompt is zeros (where model_index.json's force_zeros_for_empty_prompt is not false)."""
        return self is TextEncoding.clip_pair


LatentRgb = tuple[tuple[tuple[float, float, float], ...], tuple[float, float, float]]


class WideFloat:
    """A component's default precision where its activations exceed fp16's range (DiTs: FLUX's transformer reaches
    a relative error of 0.037 in fp16 on the tiny model, over parity's 0.02 gate, and overflows on real checkpoints):
    bf16 on a target that builds bf16 graphs (TensorRT, the way NVIDIA's demo builds DiTs), fp32 on the others
    (a CPU target's bf16 is an fp32 graph at best, and OpenVINO refuses bf16 on CPUs without AMX/AVX512-BF16, so a
    per-host choice would change the engine keys from one machine to the next)."""

    on_bf16_targets = Precision.bf16
    elsewhere = Precision.fp32

    def __repr__(self) -> str:
        return "WIDE_FLOAT"


WIDE_FLOAT = WideFloat()


@dataclass(frozen=True)
class RequestInput:
    """A request input a family adds, one number its pipeline's `__call__` takes (Z-Image's `cfg_truncation`):
    served as the optional Triton input `name` on the entries of the families that declare it, carried in
    `GenerationRequest.inputs` under `argument`, and, where a request leaves it out, `default` (diffusers' own)."""

    argument: str
    """diffusers' `__call__` argument (lower case): the key of `GenerationRequest.inputs` and of the client's."""
    data_type: type = float
    """float (FP32 on the wire) or int (INT32)."""
    default: float = 0.0
    """diffusers' default: what a request that leaves it out runs."""
    minimum: float | None = None
    maximum: float | None = None
    words: str = ""
    """What it does, for the CLI's help and the docs."""

    @property
    def name(self) -> str:
        """The Triton input's name (CFG_TRUNCATION), and the name a refusal uses."""
        return self.argument.upper()

    @property
    def triton_type(self) -> str:
        return "TYPE_INT32" if self.data_type is int else "TYPE_FP32"

    def problem(self, value) -> str | None:
        """Why `value` is refused (naming the input), or None."""
        try:
            number = float(value)
        except (TypeError, ValueError):
            return f"{self.name} must be a number, got {value!r}"
        if number != number or number in (float("inf"), float("-inf")):
            return f"{self.name} must be finite, got {value!r}"
        if self.data_type is int and number != int(number):
            return f"{self.name} must be a whole number, got {value!r}"
        low = "-inf" if self.minimum is None else f"{self.minimum:g}"
        high = "inf" if self.maximum is None else f"{self.maximum:g}"
        if (self.minimum is not None and number < self.minimum) or (self.maximum is not None and number > self.maximum):
            return f"{self.name} must be in [{low}, {high}], got {value!r}"
        return None


@dataclass(frozen=True)
class FamilyInfo:
    """One family's declaration (families/<name>.py): everything the stages ask about it."""

    components: tuple[Component, ...]
    """Every component the family has (controlnet only where the family supports one)."""
    default_components: tuple[Component, ...]
    """What a text-to-image release needs when engines.yaml does not list components."""
    latent_factor: int
    """Pixel sides must be multiples of this: the VAE's 8, times 2 where latents are patchified."""
    denoiser: Component
    temporal_factor: int = 0
    """Video families: the VAE's temporal factor (frames must be 4k+1 for Wan's 4); 0: images, no frame axis."""
    text_lengths: tuple[int, int, int] | None = None
    """(min, opt, max) prompt tokens where the text length is a profile dimension (Qwen-Image: its pipeline pads a
    batch to its longest prompt), engines.yaml's `text_length` overriding; None: prompts padded to one length."""
    cfg_kind: CfgKind = CfgKind.batched
    """How its pipeline runs guidance: engines.yaml's default `cfg` follows (`default_cfg`), and `plan` refuses a
    `cfg` whose engines its requests cannot run (`CfgKind.serving_cfg`)."""
    default_precision: Mapping[Component, Precision | WideFloat] = field(default_factory=dict)
    """Per component, the precision where engines.yaml names none (before the file-wide fallback: fp32 VAEs,
    fp16 for the rest); `WIDE_FLOAT`: bf16 where the target builds bf16 graphs, else fp32."""
    pipeline_classes: tuple[str, ...] = ()
    """model_index.json's `_class_name` of its pipelines (the variants diffusers saves), so engines.yaml's `family:`
    is checked against the folder it names; the first is the text-to-image pipeline its reference must equal."""
    workflows: tuple[str, ...] = ("txt2img",)
    """The workflows it runs (workflows.Workflow values), as diffusers' pipelines of the family do."""
    edit: EditKind | None = None
    """How its edit workflow conditions on the reference image (None: no edit workflow)."""
    lora_text_encoders: tuple[Component, ...] = ()
    """The text encoders a LoRA may change, as diffusers' LoRA loaders load them (`_lora_loadable_modules`)."""
    language_model_encoder: bool = False
    """Its text encoder is a decoder-only language model (Qwen2.5-VL, Mistral-3, Qwen3): the one text encoder the
    quantize stage takes to fp8/int8 beside the denoiser (it is the size of the denoiser, or larger)."""
    encoder_tokens: str | None = None
    """A language-model encoder's tokenization of one prompt as its pipeline makes it (its chat template), lazily
    "module:function" called (family, tokenizer, prompt, text_max) -> (input_ids, attention_mask) [1, L]; the
    quantize stage calibrates the encoder on these tokens. `text_max`: the prompt tokens kept (the entry's or the
    family's `text_lengths` max; None where neither declares one). Required with `language_model_encoder`."""
    text_layers: tuple[int, ...] | None = None
    """The hidden-state layers its text encoder engine stacks (FLUX.2's text_encoder_out_layers); None: the last."""
    engine_parts: Mapping[Component, tuple[str, ...]] = field(default_factory=dict)
    """Checkpoint key prefixes a component's engine holds where its folder holds more (a language model's vision
    tower and LM head): `plan` counts only these parameters."""
    flow_matching: bool = False
    """A flow-matching scheduler: img2img/inpaint start from scale_noise and the float product of steps and strength."""
    pooled_prompt: bool = True
    """Its prompt encoding has a pooled embedding beside the sequence (every CLIP-pooled family but SD1.5)."""
    no_ensemble: str | None = None
    """Why Triton's encode/denoise/decode stages (the ensemble) cannot serve it (the entry and the stream do); None:
    they can."""
    packed_latents: bool = False
    """Its denoiser takes 2×2 latent patches packed into channels (FLUX's, Qwen-Image's): in_channels is 4× theirs."""
    step_cache: tuple[str, ...] = ()
    """The step-cache methods (step_cache.StepCacheMethod values) its denoiser can run."""
    reference_guidance: Mapping[str, object] = field(default_factory=dict)
    """The reference pipeline's guidance arguments at their defaults, written out so a diffusers upgrade cannot
    silently change what calibration and parity run (true CFG runs only with a negative prompt: an empty one)."""
    padded_text_length: int | None = None
    """Every prompt is padded to this many tokens (its pipeline's max_sequence_length default); None: the
    tokenizer's length (`long_tokenizer`) or a text-length profile (`text_lengths`)."""
    long_tokenizer: str | None = None
    """The pipeline folder's tokenizer whose model_max_length the denoiser's text input is declared with (T5's)."""
    denoiser_tokenizers: tuple[str, ...] = ()
    """The tokenizers whose lengths, summed, make the transformer's text sequence where no padded or profiled length
    is declared (SD3: CLIP-L/G's then T5's, concatenated; FLUX.1: T5's only)."""
    quantize_exclude: tuple[str, ...] = ()
    """Layers the quantize stage keeps in higher precision for this family, beyond every family's defaults."""
    quantize_calls: str | None = None
    """How the quantize stage reads its pipeline's denoiser calls, where they are not keyword tensors, lazily as
    "module:Class" (`feeds(call)`: the engine's named inputs from a recorded call; `pipeline_output(output, call)`:
    the engine's output as the pipeline takes it back; `trace_patches()`: the legacy trace's rewrites). Z-Image's
    pipeline passes lists; None: the generic mapping (keywords, the UNet's positions), with the declaration's
    `quantize_layout` and `trace_patches`."""
    quantize_layout: str | None = None
    """Where its export's inputs differ from its pipeline's call, the function (lazily "module:function", called
    with the found inputs and the call's keywords) that rewrites a recorded call's values in place into the
    engine's declared layout (FLUX.2's unbatched ids, Qwen-Image's patch grid and mask); None: as recorded."""
    trace_patches: str | None = None
    """The rewrites its denoiser's legacy (TorchScript) ONNX trace needs, lazily "module:function" (called with the
    module, giving a context manager): Wan's out-of-place rotation, Qwen-Image's real rotary embedding, FLUX.2's
    strided rotation; None: none (or its `quantize_calls`' own)."""
    static_trace: bool = False
    """The legacy exporter bakes its denoiser's shapes (FLUX.1's rotary reshapes at the traced token count): its
    quantized graph is exported static, and says so in its manifest."""
    text_encoding: TextEncoding | None = None
    """How the UNet/SD3 loop (and FLUX.1's) encodes a prompt from its CLIP/T5 engines; None: its own loop does
    (a language-model encoder's template)."""
    system_message: bool = False
    """Its language-model encoder's chat template opens with the pipeline's system message (FLUX.2 dev's Mistral);
    False: the tokenizer's own template over the user's prompt (Klein's Qwen3)."""
    schedulers: tuple[str, ...] = ()
    """The named schedulers (runtime/schedulers.py) beside `default` (the folder's own) that suit it."""
    latent_rgb: LatentRgb | None = None
    """The live previews' fitted map from its latent channels to RGB (weights per channel, then a bias), as the
    popular UIs fit them; None: a plain map (the first three channels)."""
    single_file_keys: tuple[str, str] | None = None
    """A single-file checkpoint of the family holds the first key and keys starting with the second (diffusers'
    CHECKPOINT_KEY_NAMES, in short); None: not recognized as a single file."""
    single_file_convert: bool = False
    """Its single-file checkpoints convert to a diffusers folder (trt_diffusion/data/reference_configs/<family>)."""
    micro_model: bool = False
    """A trained micro-model ships for it (trt_diffusion/data/micro/<family>, models/micro.py, issue 43)."""
    tiny_builder: str | None = None
    """The builder of its tiny seeded pipeline (`models tiny`), lazily "module:function" called with (seed, size,
    variant), the parameters' perturbation left to models/tiny.py."""
    tiny_variants: tuple[str, ...] = ()
    """The checkpoint variants its tiny builder makes beside text-to-image (an inpainting denoiser, FLUX.1's Fill
    and Kontext, Wan's two experts and image-to-video, Qwen-Image-Edit)."""
    tiny_full_size: bool = False
    """Its tiny builder keeps the real architecture with `size="full"` (random weights; refused where the machine
    cannot hold them)."""
    tiny_lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    """The denoiser's layers the tiny LoRA covers, as its trainers make them (Wan's: every linear layer of its
    attention blocks, musubi-tuner's default)."""
    request_inputs: tuple[RequestInput, ...] = ()
    """The request inputs it adds beyond every family's (Z-Image's cfg_normalization and cfg_truncation): its entries
    declare them, the runtime checks and defaults them, the client and the CLI send them. Wan's FRAMES /
    GUIDANCE_SCALE_2 and Qwen-Image's MAX_SEQUENCE_LENGTH predate it: typed fields of every request."""
    loop: str | None = None
    """The runtime's loop for it (a runtime.family_loops.FamilyLoop, built from the pipeline), lazily as
    "module:Class" (SD1.5, SDXL and SD3: runtime/unet_loop.py's, where their `text_encoding`, `denoiser` and
    `flow_matching` say what differs between them). Every family names one."""

    @property
    def default_cfg(self) -> tuple[str, ...]:
        """engines.yaml's `cfg` where the file leaves it out (FLUX.2 dev's embedded guidance: "none", one call per
        step; Klein's and Qwen-Image's true CFG: "split", two calls as diffusers makes them; else "batched")."""
        return self.cfg_kind.default_cfg

    @property
    def reference_pipeline(self) -> str | None:
        """The diffusers pipeline class its text-to-image reference must equal."""
        return self.pipeline_classes[0] if self.pipeline_classes else None

    @property
    def is_video(self) -> bool:
        return self.temporal_factor > 0

    @property
    def supports_controlnet(self) -> bool:
        return Component.controlnet in self.components
