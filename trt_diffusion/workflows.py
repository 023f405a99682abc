"""What a request asks a model to do: text-to-image, image-to-image, inpainting, instruction editing, or (video
families) a clip from an image.

Pure vocabulary (no torch): engines.yaml declares the workflows a model serves, the runtime and the Triton entry
route each request by its workflow, and requests batch only with requests of the same workflow and options.
"""

from __future__ import annotations

from enum import Enum

from .families import FAMILIES, Component, Family


class Workflow(str, Enum):
    __str__ = str.__str__

    txt2img = "txt2img"
    img2img = "img2img"  # INIT_IMAGE, STRENGTH: start from the noised image instead of pure noise
    inpaint = "inpaint"  # INIT_IMAGE, MASK (white = repaint), STRENGTH
    edit = "edit"  # INIT_IMAGE as the instruction's context (FLUX.1 Kontext, Qwen-Image-Edit): its tokens beside the image's
    img2vid = "img2vid"  # INIT_IMAGE as the clip's first frame (Wan image-to-video checkpoints)

    @property
    def needs_image(self) -> bool:
        return self is not Workflow.txt2img

    @property
    def needs_mask(self) -> bool:
        return self is Workflow.inpaint

    @property
    def takes_strength(self) -> bool:
        return self in (Workflow.img2img, Workflow.inpaint)

    @property
    def encodes_image(self) -> bool:
        """Whether the workflow runs the VAE encoder (every image-conditioned one does)."""
        return self.needs_image


# Which family runs which workflow, as diffusers' pipelines do: each family's declaration says (families/<name>.py)
FAMILY_WORKFLOWS: dict[Family, tuple[Workflow, ...]] = {
    family: tuple(Workflow(name) for name in info.workflows) for family, info in FAMILIES.items()}

# The checkpoint (model_index.json `_class_name`) an edit workflow needs: editing is a trained skill, not a
# sampling mode, so a plain FLUX.1 checkpoint is refused for it.
EDIT_PIPELINE_CLASSES = ("FluxKontextPipeline", "QwenImageEditPipeline")
# Image-to-video is a checkpoint of its own too: its transformer takes the conditioning clip's channels.
IMAGE_TO_VIDEO_PIPELINE_CLASSES = ("WanImageToVideoPipeline",)



def edit_pipeline_classes(pipeline_class: str | None) -> tuple[str, ...]:
    """The edit checkpoints of the family whose pipeline `pipeline_class` is (every family's where unknown)."""
    from .families import family_of_pipeline_class

    family = family_of_pipeline_class(pipeline_class or "")
    return tuple(c for c in EDIT_PIPELINE_CLASSES if family is None or family_of_pipeline_class(c) is family)


DEFAULT_STRENGTH = {Workflow.img2img: 0.8, Workflow.inpaint: 1.0}  # diffusers' SD img2img / inpaint defaults


def families_that_run(workflow: Workflow) -> list[str]:
    return [family.value for family, workflows in FAMILY_WORKFLOWS.items() if workflow in workflows]


def workflow_components(workflows, image_encoder: bool = False) -> tuple[Component, ...]:
    """The components the workflows add to a text-to-image release; `image_encoder`: the checkpoint has one
    (Wan 2.1 I2V; Qwen-Image-Edit's vision tower), which img2vid or edit then runs beside the VAE encoder."""
    workflows = [Workflow(w) for w in workflows]
    added = (Component.vae_encoder,) if any(w.encodes_image for w in workflows) else ()
    if image_encoder and (Workflow.img2vid in workflows or Workflow.edit in workflows):
        added = (Component.image_encoder, *added)
    return added


def request_workflow(workflow: str | None, has_image: bool, has_mask: bool, video: bool = False) -> Workflow:
    """The workflow a request asks for: WORKFLOW when given, else what its inputs imply (an INIT_IMAGE means
    img2img — img2vid for a video request —, an INIT_IMAGE with a MASK inpaint). Raises ValueError for a name that
    is not a workflow."""
    if workflow:
        try:
            return Workflow(workflow)
        except ValueError:
            raise ValueError(f"unknown WORKFLOW {workflow!r}; choose one of "
                             f"{', '.join(w.value for w in Workflow)}") from None
    if has_image:
        if has_mask:
            return Workflow.inpaint
        return Workflow.img2vid if video else Workflow.img2img
    return Workflow.txt2img
