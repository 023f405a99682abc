"""What the API serves: Triton's loaded trt-diffusion entries (role `entry`) of image families, read from the
server itself (so `openai-api --triton-url` works from another host). The reading is kept for `max_age_s` and
re-read when a request needs it after that: a request naming a model the reading lacks (a repository reloaded
since) is answered from it meanwhile, so a stream of bad model names costs Triton one reading per `max_age_s`, not
one per request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..families import family_info
from ..triton.configs import ROLE
from .errors import ApiError, bad_request

LORAS_INPUT = "LORAS"  # the per-request LoRA input, where the repository declares it


@dataclass(frozen=True)
class ServedModel:
    name: str  # the entry model: what OpenAI's `model` names
    family: str
    sizes: tuple[str, ...]  # "WxH" the entry serves, one per bucket
    max_images: int
    workflows: tuple[str, ...]
    inputs: frozenset[str]
    created: int  # when this API first saw it (Triton records no creation time)

    @property
    def takes_loras(self) -> bool:
        return LORAS_INPUT in self.inputs


def is_video_entry(parameters: dict[str, str]) -> bool:
    """Whether a pipeline entry answers clips: its family's kind as packaged; an entry that records no family serves
    images (as before families were recorded)."""
    family = parameters.get("family")
    return bool(family) and family_info(family).is_video


def _parameters(config) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


class Catalog:
    def __init__(self, client, max_age_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.client = client  # tritonclient.grpc.aio.InferenceServerClient
        self.max_age_s = max_age_s
        self.clock = clock
        self._models: dict[str, ServedModel] | None = None
        self._read_at = 0.0
        self._first_seen: dict[str, int] = {}
        self._lock: asyncio.Lock | None = None  # made on first use, in the server's event loop

    async def models(self) -> dict[str, ServedModel]:
        """The served models: the last reading while it is younger than max_age_s, else a new one (one at a time:
        requests arriving meanwhile share it)."""
        if self._fresh():
            return self._models
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if not self._fresh():
                self._models = await self._read()
                self._read_at = self.clock()
        return self._models

    def _fresh(self) -> bool:
        return self._models is not None and self.clock() - self._read_at < self.max_age_s

    async def _read(self) -> dict[str, ServedModel]:
        index = await self.client.get_model_repository_index()
        served = {}
        for entry in index.models:
            if entry.state and entry.state != "READY":
                continue
            config = (await self.client.get_model_config(entry.name)).config
            parameters = _parameters(config)
            if parameters.get(ROLE) != "entry" or is_video_entry(parameters):
                continue  # engines, stages, streams; a video entry answers clips, not images
            self._first_seen.setdefault(entry.name, int(time.time()))
            served[entry.name] = ServedModel(
                name=entry.name, family=parameters.get("family", ""),
                sizes=tuple(s for s in parameters.get("request_sizes", "").split(";") if s),
                max_images=int(parameters.get("max_images") or 1),
                workflows=tuple(w for w in parameters.get("workflows", "txt2img").split(";") if w),
                inputs=frozenset(tensor.name for tensor in config.input), created=self._first_seen[entry.name])
        return served

    async def resolve(self, name: str | None) -> ServedModel:
        """The model a request names; 404 listing the served ones. No name: the only model, else 400."""
        models = await self.models()
        listed = ", ".join(sorted(models)) or "none"
        if name is None:
            if len(models) != 1:
                raise bad_request(f"model is required: this server serves {len(models)} models ({listed})", "model")
            return next(iter(models.values()))
        if name not in models:
            raise ApiError(404, f"model {name!r} is not served; served: {listed}", "model", "model_not_found")
        return models[name]


def check_size(size: str | None, model: ServedModel) -> tuple[int, int]:
    """(width, height) of the request: `size` must be one of the model's; None: its first."""
    chosen = size or model.sizes[0]
    if chosen not in model.sizes:
        raise bad_request(f"size {chosen} is not served by {model.name}; served sizes: {', '.join(model.sizes)}",
                          "size")
    width, _, height = chosen.partition("x")
    return int(width), int(height)


def check_n(n: int, model: ServedModel) -> None:
    if n > model.max_images:
        raise bad_request(f"n is {n}; {model.name} makes at most {model.max_images} images a request", "n")
