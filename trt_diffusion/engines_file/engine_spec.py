"""EngineSpec: one engine to build, and its stable key.

The key hashes every field that changes the engine's bytes (and nothing else), so the same
engines.yaml gives the same keys in any process, and a change to one field changes exactly the
keys of the engines that field touches.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace

from ..errors import ConfigError
from ..families import Component, Family
from ..precision import Precision

SPEC_SCHEMA_VERSION = 1


@dataclass(frozen=True, order=True)
class Size:
    """An image size in pixels, or a video's: width × height × frames (`frames` 0 for an image)."""

    width: int
    height: int
    frames: int = 0

    @classmethod
    def parse(cls, text: str) -> Size:
        """Parse 'WxH' (e.g. '768x512' is 768 wide, 512 high) or a video's 'WxHxF' ('832x480x81': 81 frames)."""
        parts = str(text).lower().replace(" ", "").split("x")
        if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
            raise ValueError(f"expected WIDTHxHEIGHT like '512x512' (or WIDTHxHEIGHTxFRAMES for video, "
                             f"'832x480x81'), got {text!r}")
        values = [int(p) for p in parts]
        if any(v <= 0 for v in values):
            raise ValueError(f"sides and frames must be positive, got {text!r}")
        return cls(*values)

    def __str__(self) -> str:
        return f"{self.width}x{self.height}" + (f"x{self.frames}" if self.frames else "")

    @property
    def is_video(self) -> bool:
        return self.frames > 0

    def latent(self, factor: int) -> tuple[int, int]:
        """(height, width) in latent pixels for a VAE that downsamples by `factor`."""
        return self.height // factor, self.width // factor

    def latent_frames(self, temporal_factor: int) -> int:
        """Latent frames of a causal video VAE that keeps the first frame and packs each further
        `temporal_factor` frames into one: (F - 1) / factor + 1 (Wan: 81 frames -> 21)."""
        return (self.frames - 1) // temporal_factor + 1 if self.frames else 0


@dataclass(frozen=True)
class Bucket:
    """A resolution bucket: a static size (min == opt == max) or a range one engine covers."""

    min: Size
    opt: Size
    max: Size

    @classmethod
    def static(cls, size: Size) -> Bucket:
        return cls(size, size, size)

    @property
    def is_static(self) -> bool:
        return self.min == self.opt == self.max

    def covers(self, size: Size) -> bool:
        return ((self.min.width <= size.width <= self.max.width) and (self.min.height <= size.height <= self.max.height)
                and self.min.frames <= size.frames <= self.max.frames)

    @property
    def label(self) -> str:
        return str(self.opt) if self.is_static else f"{self.min}..{self.max}"

    def to_json(self) -> dict:
        return {"min": str(self.min), "opt": str(self.opt), "max": str(self.max)}


@dataclass(frozen=True)
class LoraVariant:
    """LoRAs merged into an engine's weights before build (the `fused` mode)."""

    name: str
    sources: tuple[tuple[str, str, float], ...]  # (lora name, file identity, scale)


@dataclass(frozen=True)
class EngineSpec:
    model: str
    family: Family
    source: str  # identity of the model weights: a resolved folder path or repo@revision
    component: Component
    target: str  # a registered target's name (target_registry): targets are plugins, not an enum
    precision: Precision
    batch: int  # the engine's batch dimension (for denoisers: CFG-doubled when CFG is batched)
    bucket: Bucket | None  # None for components that do not depend on resolution (text encoders)
    controlnet: str | None = None  # the ControlNet's name, for controlnet engines
    controlnet_source: str | None = None
    lora_variant: LoraVariant | None = None
    refittable: bool = False
    build_options: tuple[tuple[str, object], ...] = ()  # target/stage options that change the engine
    # `engine_layout: profiles`: one engine for every (bucket, batch) shape of one weight set, one optimization
    # profile each, in TensorRT's order; `bucket` and `batch` are then profile 0's. Empty (every per-shape spec):
    # one shape, `bucket` and `batch`; left out of the key then, so per-shape keys are what they were.
    profiles: tuple[tuple[Bucket | None, int], ...] = ()
    # A step cache's piece of the denoiser (step_cache.PIECES: unet_deep, unet_shallow, first_block, rest_blocks);
    # None: the whole component. Left out of the key when None, so every other key is what it was.
    piece: str | None = None
    reasons: tuple[str, ...] = field(default=(), compare=False)  # why it exists; not part of the key

    def __post_init__(self) -> None:
        # Specs read back from JSON (manifests, Ray tasks) or written by hand hold names: make them the enums.
        # They are str-enums, so keys, names and comparisons with names are unchanged.
        for name, kind in (("family", Family), ("component", Component), ("precision", Precision)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                raise ConfigError(f"unknown {name} {value!r} in the spec of {self.model!r} (known: "
                                  f"{', '.join(member.value for member in kind)})") from None
        if self.profiles:  # read back from JSON: {"bucket": {...} | None, "batch": n} or [bucket, batch]
            object.__setattr__(self, "profiles", tuple(_profile_entry(entry) for entry in self.profiles))

    def key_fields(self) -> dict:
        fields = asdict(self)
        fields.pop("reasons")
        fields["bucket"] = self.bucket.to_json() if self.bucket else None
        fields.pop("profiles")
        if fields.get("piece") is None:
            fields.pop("piece", None)
        if self.profiles:
            fields["profiles"] = [{"bucket": b.to_json() if b else None, "batch": n} for b, n in self.profiles]
        fields["schema"] = SPEC_SCHEMA_VERSION
        return fields

    @property
    def members(self) -> tuple[EngineSpec, ...]:
        """One per-shape spec per optimization profile, in profile order (the spec itself when it has one shape):
        what each profile is built and routed for."""
        if not self.profiles:
            return (self,)
        return tuple(replace(self, bucket=bucket, batch=batch, profiles=(), reasons=())
                     for bucket, batch in self.profiles)

    @property
    def buckets(self) -> tuple[Bucket | None, ...]:
        """The distinct buckets the engine serves, in profile order."""
        return tuple(dict.fromkeys(member.bucket for member in self.members))

    @property
    def batches(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(member.batch for member in self.members))

    def weight_set_fields(self) -> dict:
        """What the engine's weights depend on: every key field but the shapes (bucket, batch, profiles)."""
        fields = self.key_fields()
        for name in ("bucket", "batch", "profiles"):
            fields.pop(name, None)
        return fields

    @classmethod
    def with_profiles(cls, specs: tuple[EngineSpec, ...] | list[EngineSpec]) -> EngineSpec:
        """One engine for these per-shape specs of one weight set, one optimization profile each (in this order)."""
        head = specs[0]
        if any(s.weight_set_fields() != head.weight_set_fields() or s.profiles for s in specs):
            raise ValueError("only per-shape specs of one weight set share an engine")
        reasons = tuple(dict.fromkeys(r for s in specs for r in s.reasons))
        return replace(head, profiles=tuple((s.bucket, s.batch) for s in specs), reasons=reasons)

    @property
    def key(self) -> str:
        canonical = json.dumps(self.key_fields(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        """A readable, unique-enough file name stem: model.component[.controlnet][.lora].bucket.bN.precision"""
        parts = [self.model, self.piece or self.component]
        if self.controlnet:
            parts.append(self.controlnet)
        if self.lora_variant:
            parts.append(f"lora-{self.lora_variant.name}")
        if self.profiles:  # one engine, a profile per shape: the shapes are its manifest's, not its name's
            parts.append(f"{len(self.profiles)}profiles")
        else:
            if self.bucket:
                parts.append(self.bucket.label.replace("..", "-"))
            parts.append(f"b{self.batch}")
        parts.append(self.precision)
        if self.option("architecture"):  # a GPU architecture the engine is built for (tensorrt)
            parts.append(str(self.option("architecture")))
        # One path component whatever the names hold (the schema already refuses unsafe names).
        return re.sub(r"[^A-Za-z0-9._+-]", "_", ".".join(parts))

    @property
    def label(self) -> str:
        """The component as plan rows and messages name it: the piece of a step cache where it is one."""
        return self.piece or self.component.value

    def option(self, name: str, default=None):
        return dict(self.build_options).get(name, default)


def _profile_entry(entry) -> tuple[Bucket | None, int]:
    if isinstance(entry, dict):
        bucket, batch = entry.get("bucket"), entry["batch"]
    else:
        bucket, batch = entry
    if isinstance(bucket, dict):
        bucket = Bucket(*(Size.parse(bucket[k]) for k in ("min", "opt", "max")))
    return bucket, int(batch)
