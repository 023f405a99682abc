"""The schedulers users expect, by name. Each request gets its own instance: no state is shared."""

from __future__ import annotations

from ..errors import RuntimeInputError

# name -> (diffusers class, config overrides, families it suits)
_UNET = ("sd15", "sdxl")
_DIT = ("sd3", "flux")
_WAN = ("wan",)  # default: the folder's UniPC (flow_prediction, flow sigmas, flow_shift)
SCHEDULERS = {
    "euler": ("EulerDiscreteScheduler", {}, _UNET),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}, _UNET),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler",
                        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True}, _UNET),
    "ddim": ("DDIMScheduler", {}, _UNET),
    "unipc": ("UniPCMultistepScheduler", {}, _UNET + _WAN),
    "flow_euler": ("FlowMatchEulerDiscreteScheduler", {}, _DIT + _WAN),
}


def scheduler_names(family: str) -> list[str]:
    return ["default"] + [name for name, (_, _, families) in SCHEDULERS.items() if family in families]


def make_scheduler(name: str, base_config: dict, family: str):
    """A fresh scheduler: `default` is the model folder's own; others are built from its config."""
    import diffusers

    if name == "default":
        cls = getattr(diffusers, base_config["_class_name"])
        return cls.from_config(base_config)
    if name not in SCHEDULERS or family not in SCHEDULERS[name][2]:
        raise RuntimeInputError(f"unknown scheduler {name!r} for {family}; choose one of "
                                f"{', '.join(scheduler_names(family))}")
    class_name, overrides, _ = SCHEDULERS[name]
    if name == "flow_euler" and "flow_shift" in base_config:
        # Wan's UniPC config names the shift `flow_shift`; FlowMatchEulerDiscreteScheduler calls it `shift` (the
        # FlowMatchEulerDiscreteScheduler(shift=3.0) diffusers' Wan docs pair with WanPipeline)
        overrides = {**overrides, "shift": base_config["flow_shift"]}
    if name == "flow_euler" and base_config["_class_name"] == class_name:
        return getattr(diffusers, class_name).from_config(base_config)
    return getattr(diffusers, class_name).from_config(base_config, **overrides)
