"""Engine layouts: one plan per shape, or one plan per weight set with one optimization profile per shape.

Every per-shape plan carries all of its weights: a release with 6 SDXL UNet shapes (~5 GB of fp16 weights each)
holds 6 copies on the GPU, a FLUX bf16 transformer ~24 GB per shape. `engine_layout: profiles` builds one engine
per (model, component, ControlNet, precision, LoRA variant, build options) with one optimization profile per
bucket × batch shape: TensorRT still chooses tactics per profile, the weights are held once, and the runner
selects the profile that fits a request (`IExecutionContext.set_optimization_profile_async`).

Pure decisions, tested on CPU: which specs share an engine (`profile_groups`; engines.yaml's expansion merges
them the same way, `EngineSpec.weight_set_fields`), what each layout holds in GPU memory (`layout_memory`, what
`plan` shows), which profile a request runs in (`select_profile`: the one the runtime's route names when it holds
the shapes, else the tightest), and the one envelope a multi-profile manifest's feeds are first checked against
(`profile_envelope`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ...engines_file.engine_spec import EngineSpec

LAYOUTS = ("per_shape", "profiles")
Shape = tuple[int, ...]
Profile = Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[int]]]


def weight_set_key(spec: EngineSpec) -> str:
    """What the weights of an engine depend on: everything of its spec but the bucket and the batch."""
    import json

    return json.dumps(spec.weight_set_fields(), sort_keys=True, default=str)


@dataclass(frozen=True)
class ProfileGroup:
    """Specs (one per bucket × batch shape) built as the optimization profiles of one engine, in this order."""

    specs: tuple[EngineSpec, ...]

    @property
    def name(self) -> str:
        head = self.specs[0]
        return f"{head.model}.{head.component}{'.' + head.controlnet if head.controlnet else ''}.{head.precision}" \
               f".{len(self.specs)}profiles"


def profile_groups(specs: Iterable[EngineSpec]) -> list[ProfileGroup]:
    """The engines `engine_layout: profiles` builds: specs that differ only in bucket and batch share one. Order:
    first appearance; inside a group the specs' order (profile 0 is the first, which is TensorRT's default)."""
    groups: dict[str, list[EngineSpec]] = {}
    for spec in specs:
        groups.setdefault(weight_set_key(spec), []).append(spec)
    return [ProfileGroup(tuple(members)) for members in groups.values()]


@dataclass(frozen=True)
class LayoutMemory:
    """GPU memory of one row of `plan` (one model/component/precision) under each layout."""

    engines_per_shape: int
    engines_profiles: int
    per_shape_bytes: int  # every per-shape engine loaded: one copy of the weights each
    profiles_bytes: int  # one copy per weight set (LoRA variants are weight sets of their own)

    @property
    def saved_bytes(self) -> int:
        return self.per_shape_bytes - self.profiles_bytes


def layout_memory(specs: Sequence[EngineSpec], weight_bytes_per_engine: int) -> LayoutMemory:
    """Weights held on the GPU when every engine of `specs` is loaded, per layout. Activations are not here: they
    differ by who runs the engine, not by layout alone (served_memory.py: trt-diffusion's runner shares one
    allocation among a group's engines; Triton's TensorRT backend holds one per context, a context per listed
    profile), and `plan` reports them per row (`PlanRow.activations`)."""
    groups = profile_groups(specs)
    return LayoutMemory(len(specs), len(groups), len(specs) * weight_bytes_per_engine,
                        len(groups) * weight_bytes_per_engine)


def _fits(profile: Profile, shapes: Mapping[str, Sequence[int]]) -> bool:
    for name, shape in shapes.items():
        if name not in profile:
            continue
        low, _, high = profile[name]
        if len(shape) != len(low) or not all(lo <= d <= hi for d, lo, hi in zip(shape, low, high)):
            return False
    return True


def select_profile(profiles: Sequence[Profile], shapes: Mapping[str, Sequence[int]],
                   preferred: int | None = None) -> int | None:
    """The index of the profile a request with these input shapes runs in: `preferred` (the profile the runtime
    routed the request's bucket and batch to) when it holds every shape; else, of those whose ranges hold every
    shape, the tightest (smallest max volume: its tactics were chosen for shapes nearest these); None if none."""
    if preferred is not None and 0 <= preferred < len(profiles) and _fits(profiles[preferred], shapes):
        return preferred
    def volume(profile: Profile) -> int:
        total = 0
        for low_opt_high in profile.values():
            size = 1
            for d in low_opt_high[2]:
                size *= int(d)
            total += size
        return total

    fitting = [i for i, profile in enumerate(profiles) if _fits(profile, shapes)]
    return min(fitting, key=lambda i: (volume(profiles[i]), i)) if fitting else None


def profile_envelope(profiles: Sequence[Profile]) -> dict[str, tuple[Shape, Shape, Shape]]:
    """Per input: the smallest min, the first profile's opt and the largest max over all profiles (what a
    manifest's `profile_shapes` says of a multi-profile engine; the buffers are sized for its max)."""
    names = list(profiles[0])
    envelope = {}
    for name in names:
        lows = [tuple(int(d) for d in p[name][0]) for p in profiles]
        highs = [tuple(int(d) for d in p[name][2]) for p in profiles]
        low = tuple(min(dims) for dims in zip(*lows))
        high = tuple(max(dims) for dims in zip(*highs))
        envelope[name] = (low, tuple(int(d) for d in profiles[0][name][1]), high)
    return envelope
