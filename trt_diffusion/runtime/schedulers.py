"""The schedulers users expect, by name. Each request gets its own instance: no state is shared."""

from __future__ import annotations

from ..errors import RuntimeInputError
from ..families import family_info

# name -> (diffusers class, config overrides); the families each suits are their declarations' `schedulers`
SCHEDULERS = {
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler",
                        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True}),
    "ddim": ("DDIMScheduler", {}),
    "unipc": ("UniPCMultistepScheduler", {}),
    "flow_euler": ("FlowMatchEulerDiscreteScheduler", {}),
}


def scheduler_names(family: str) -> list[str]:
    suited = family_info(family).schedulers
    return ["default"] + [name for name in SCHEDULERS if name in suited]


def make_scheduler(name: str, base_config: dict, family: str):
    """A fresh scheduler: `default` is the model folder's own; others are built from its config."""
    import diffusers

    if name == "default":
        cls = getattr(diffusers, base_config["_class_name"])
        return cls.from_config(base_config)
    if name not in SCHEDULERS or name not in family_info(family).schedulers:
        raise RuntimeInputError(f"unknown scheduler {name!r} for {family}; choose one of "
                                f"{', '.join(scheduler_names(family))}")
    class_name, overrides = SCHEDULERS[name]
    if name == "flow_euler" and "flow_shift" in base_config:
        # Wan's UniPC config names the shift `flow_shift`; FlowMatchEulerDiscreteScheduler calls it `shift` (the
        # FlowMatchEulerDiscreteScheduler(shift=3.0) diffusers' Wan docs pair with WanPipeline)
        overrides = {**overrides, "shift": base_config["flow_shift"]}
    if name == "flow_euler" and base_config["_class_name"] == class_name:
        return getattr(diffusers, class_name).from_config(base_config)
    return getattr(diffusers, class_name).from_config(base_config, **overrides)
