"""The serving contract: what a client sends and gets back, and the tensors passed between the stages.

One declaration used by the repository writer (configs), the python models (parsing) and the client, so the
three cannot drift apart. Pipeline models have `max_batch_size: 1` (the queue policy needs dynamic batching,
which needs batching): every tensor below gets a leading batch dimension of 1 on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..families import Family, family_info, request_inputs_of_all


@dataclass(frozen=True)
class TensorDecl:
    name: str
    data_type: str  # Triton's TYPE_* name
    dims: tuple[int, ...]  # without the batch dimension; -1 is any size
    optional: bool = False


def _scalar(name: str, data_type: str, optional: bool = False) -> TensorDecl:
    return TensorDecl(name, data_type, (1,), optional)


REQUEST_INPUTS: tuple[TensorDecl, ...] = (
    _scalar("PROMPT", "TYPE_STRING"),
    _scalar("NEGATIVE_PROMPT", "TYPE_STRING", optional=True),
    _scalar("HEIGHT", "TYPE_INT32"),
    _scalar("WIDTH", "TYPE_INT32"),
    _scalar("STEPS", "TYPE_INT32"),
    _scalar("GUIDANCE_SCALE", "TYPE_FP32"),
    _scalar("SEED", "TYPE_INT64"),
    _scalar("SCHEDULER", "TYPE_STRING", optional=True),
)
# Image-conditioned workflows (issue 25): declared on every entry, whatever it serves, so a request for a workflow
# the model lacks is answered in the pipeline's words ("WORKFLOW inpaint is not served ..."), not Triton's
# "unexpected inference input". WORKFLOW absent: what the other inputs imply (INIT_IMAGE: img2img — img2vid on
# a video request, one with FRAMES —, + MASK: inpaint, neither: txt2img; workflows.request_workflow). Images are
# the request's size: never resized.
WORKFLOW_INPUTS: tuple[TensorDecl, ...] = (
    _scalar("WORKFLOW", "TYPE_STRING", optional=True),  # txt2img | img2img | inpaint | edit | img2vid
    TensorDecl("INIT_IMAGE", "TYPE_UINT8", (-1, -1, 3), optional=True),  # [H, W, 3] RGB; img2vid: the first frame
    TensorDecl("MASK", "TYPE_UINT8", (-1, -1), optional=True),  # [H, W], white (>= 128) is repainted
    _scalar("STRENGTH", "TYPE_FP32", optional=True),  # (0, 1]; absent: the workflow's default
)
# Video (issue 24): declared on every entry too, so FRAMES sent to an image model is refused in the pipeline's
# words. FRAMES absent: an image request; a video model then names the frames it needs.
VIDEO_INPUTS: tuple[TensorDecl, ...] = (
    _scalar("FRAMES", "TYPE_INT32", optional=True),  # 4k+1 (Wan), a frame count the entry's engines serve
    _scalar("GUIDANCE_SCALE_2", "TYPE_FP32", optional=True),  # Wan 2.2's low-noise expert; absent: GUIDANCE_SCALE
)
# Text length (issue 26): declared on every entry too, so MAX_SEQUENCE_LENGTH sent to a family whose prompts are
# padded to one length is refused in the pipeline's words. Qwen-Image: prompt tokens kept after its template
# (diffusers' max_sequence_length), within the engines' text_length range; absent: 512, or that range's max if lower.
TEXT_INPUTS: tuple[TensorDecl, ...] = (
    _scalar("MAX_SEQUENCE_LENGTH", "TYPE_INT32", optional=True),
)
# LoRA per request (issue 28): declared on every entry, so a set sent to a repository without LoRAs is refused
# by name ("unknown LoRA 'x'; this model serves: none"). A JSON string [{"name": "style", "scale": 0.8}, ...]
# (lora_sets.py); absent or []: the base model.
LORA_INPUTS: tuple[TensorDecl, ...] = (
    _scalar("LORAS", "TYPE_STRING", optional=True),
)
# The request parameter through which the entry hands a batch's canonical set to the engine models (BLS)
LORAS_PARAMETER = "trt_diffusion_loras"
# What a LoRA-serving engine model answers beside its engine's outputs: seconds this call spent switching sets
LORA_SWITCH_S = TensorDecl("LORA_SWITCH_S", "TYPE_FP32", (1,))
# Step caching (issue 30): declared on every entry too. "on" | "off"; absent: engines.yaml's step_cache.enabled (a
# model without a step cache runs every step whole whatever is sent; a value other than on/off is refused).
STEP_CACHE_INPUTS: tuple[TensorDecl, ...] = (
    _scalar("STEP_CACHE", "TYPE_STRING", optional=True),
)
CONTROLNET_INPUTS: tuple[TensorDecl, ...] = (
    _scalar("CONTROLNET", "TYPE_STRING", optional=True),
    TensorDecl("CONTROL_IMAGE", "TYPE_UINT8", (-1, -1, 3), optional=True),
    _scalar("CONTROLNET_SCALE", "TYPE_FP32", optional=True),
)
IMAGE = TensorDecl("IMAGE", "TYPE_UINT8", (-1, -1, 3))
# A video family's result in IMAGE's place: [N, F, H, W, 3], N = NUM_IMAGES videos
VIDEO = TensorDecl("VIDEO", "TYPE_UINT8", (-1, -1, -1, 3))
# The public entry only: images for this request, seeds SEED, SEED + 1, ...; IMAGE is then [N, H, W, 3]
NUM_IMAGES = _scalar("NUM_IMAGES", "TYPE_INT32", optional=True)
# The streaming entry: a preview every PREVIEW_EVERY steps (default below), then the image
PREVIEW_EVERY = _scalar("PREVIEW_EVERY", "TYPE_INT32", optional=True)
PREVIEW = TensorDecl("PREVIEW", "TYPE_UINT8", (-1, -1, 3))
VIDEO_PREVIEW = TensorDecl("PREVIEW", "TYPE_UINT8", (-1, -1, -1, 3))  # one preview per latent frame [f, h, w, 3]
STEP = _scalar("STEP", "TYPE_INT32")  # in a preview response: steps done so far
DEFAULT_PREVIEW_EVERY = 5
# Request parameter a client may set (time.time_ns() when it sent the request, same host): gives queue_s
SENT_NS_PARAMETER = "trt_diffusion_sent_ns"
TIMING_PARAMETER = "timing"  # response parameter: JSON of the request's timings
# Request parameter the OpenAI API's batch and video jobs send (openai_api/job_slots.BatchPriorityClient), value
# PRIORITY_BATCH_VALUE: such a request pauses between engine calls while a person's request (one without it) runs
# on another instance of the pipeline (backend/activity.py); a running job yields, it is not killed
PRIORITY_PARAMETER = "trt_diffusion_priority"
PRIORITY_BATCH_VALUE = "batch"
# The same JSON as an output (Triton 2.51's python backend cannot set response parameters): sent only to
# clients that ask for it, so one-image clients asking for IMAGE see no change.
TIMING = _scalar("TIMING", "TYPE_STRING")

# Between the ensemble's stages
LATENTS = TensorDecl("LATENTS", "TYPE_FP32", (-1, -1, -1, -1))  # [B, C, h, w]
USE_NEGATIVE = _scalar("USE_NEGATIVE", "TYPE_BOOL")  # False: no CFG, the NEGATIVE_* tensors are placeholders
PROMPT_ONLY = ("PROMPT", "NEGATIVE_PROMPT")  # request inputs the denoise stage does not need


def family_inputs(family: Family | str | None = None) -> tuple[TensorDecl, ...]:
    """The optional scalars a family's declaration adds to its entries (`FamilyInfo.request_inputs`: Z-Image's
    CFG_NORMALIZATION and CFG_TRUNCATION); only its entries declare them, so another's refuses them as Triton
    refuses any unknown input. None: every family's (what the client may send)."""
    declared = request_inputs_of_all().values() if family is None else family_info(family).request_inputs
    return tuple(_scalar(d.name, d.triton_type, optional=True) for d in declared)


def request_inputs(has_controlnets: bool, family: Family | str | None = None) -> tuple[TensorDecl, ...]:
    """What a request to an entry may hold; with `family`, that family's own inputs too."""
    return (REQUEST_INPUTS + WORKFLOW_INPUTS + VIDEO_INPUTS + TEXT_INPUTS + LORA_INPUTS + STEP_CACHE_INPUTS
            + (CONTROLNET_INPUTS if has_controlnets else ()) + (family_inputs(family) if family is not None else ()))


def result_tensor(family: Family | str) -> TensorDecl:
    """What the entry answers with: IMAGE, or VIDEO for a video family."""
    return VIDEO if family_info(family).is_video else IMAGE


def has_pooled(family: Family | str) -> bool:
    return family_info(family).pooled_prompt


def encoding_tensors(family: Family | str) -> tuple[TensorDecl, ...]:
    """The encode stage's outputs: prompt embeddings (+ pooled where the family has them) and the CFG flag."""
    tensors = [TensorDecl("POSITIVE_EMBEDS", "TYPE_FP32", (-1, -1, -1)),
               TensorDecl("NEGATIVE_EMBEDS", "TYPE_FP32", (-1, -1, -1))]
    if has_pooled(family):
        tensors += [TensorDecl("POSITIVE_POOLED", "TYPE_FP32", (-1, -1)),
                    TensorDecl("NEGATIVE_POOLED", "TYPE_FP32", (-1, -1))]
    return tuple(tensors + [USE_NEGATIVE])


def stage_io(stage: str, family: Family | str, has_controlnets: bool
             ) -> tuple[tuple[TensorDecl, ...], tuple[TensorDecl, ...]]:
    """(inputs, outputs) of a pipeline python model: `full` (the public entry), `encode`, `denoise`, `decode`."""
    request = request_inputs(has_controlnets, family)
    result = result_tensor(family)
    if stage == "full":
        return request + (NUM_IMAGES,), (result, TIMING)
    if stage == "stream":
        preview = VIDEO_PREVIEW if result is VIDEO else PREVIEW
        return request + (PREVIEW_EVERY,), (result, preview, STEP, TIMING)
    if (why := family_info(family).no_ensemble) is not None:  # the family's declaration says why
        raise ValueError(f"a {Family(family).value} pipeline has no {stage!r} stage: it is served by the entry and "
                         f"the stream (no ensemble: {why})")
    if stage == "encode":  # gets the whole request so it can refuse a bad one before any engine runs
        return request, encoding_tensors(family)
    if stage == "denoise":
        kept = tuple(t for t in request if t.name not in PROMPT_ONLY)
        return kept + encoding_tensors(family), (LATENTS,)
    if stage == "decode":
        by_name = {t.name: t for t in request}
        return (LATENTS, by_name["HEIGHT"], by_name["WIDTH"]), (IMAGE,)
    raise ValueError(f"unknown pipeline stage {stage!r}")


STAGES = ("full", "stream", "encode", "denoise", "decode")
ENSEMBLE_STAGES = ("encode", "denoise", "decode")


# numpy dtype name (as engine manifests write it) <-> Triton data type
NUMPY_TO_TRITON = {
    "float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "float64": "TYPE_FP64",
    "int64": "TYPE_INT64", "int32": "TYPE_INT32", "int16": "TYPE_INT16", "int8": "TYPE_INT8",
    "uint8": "TYPE_UINT8", "bool": "TYPE_BOOL",
}
TRITON_TO_WIRE = {  # Triton config type -> the client protocol's datatype string
    "TYPE_FP32": "FP32", "TYPE_FP16": "FP16", "TYPE_BF16": "BF16", "TYPE_FP64": "FP64", "TYPE_INT64": "INT64",
    "TYPE_INT32": "INT32", "TYPE_INT16": "INT16", "TYPE_INT8": "INT8", "TYPE_UINT8": "UINT8", "TYPE_BOOL": "BOOL",
    "TYPE_STRING": "BYTES",
}
