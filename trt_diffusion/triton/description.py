"""pipeline.json: what a pipeline python model needs to rebuild, inside Triton, the RunnerTable the
in-process pipeline uses: every engine's Triton model name, routing keys (component, bucket, batch,
ControlNet) and I/O, all taken from the BuiltEngine list the repository was generated from; and the
workflows and CFG modes engines.yaml declares for the model (EnginePipeline's `workflows` and `cfg`), and a
Qwen-Image model's text_length range (`text_lengths`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..engines_file.engine_spec import Bucket, Size
from ..errors import ServeError
from ..step_cache import StepCache, StepCacheMethod
from ..tensors import TensorSpec

SCHEMA_VERSION = 1
FILE_NAME = "pipeline.json"
SKELETON_DIR = "model"  # the model folder's configs and tokenizers, beside pipeline.json
DEFAULT_WORKFLOWS = ("txt2img",)


@dataclass(frozen=True)
class EngineEntry:
    model: str  # the Triton model serving this engine
    component: str
    bucket: dict | None  # Bucket.to_json()
    batch: int
    controlnet: str | None
    inputs: tuple[TensorSpec, ...]  # named, dtype as the engine manifest writes it, -1: dynamic
    outputs: tuple[TensorSpec, ...]
    # the served LoRAs this engine holds a part of (its model switches sets per request, answers LORA_SWITCH_S)
    loras: tuple[str, ...] = ()

    @property
    def bucket_object(self) -> Bucket | None:
        if self.bucket is None:
            return None
        return Bucket(*(Size.parse(self.bucket[k]) for k in ("min", "opt", "max")))


@dataclass(frozen=True)
class PipelineDescription:
    pipeline: str
    family: str
    engines: tuple[EngineEntry, ...]
    schema_version: int = SCHEMA_VERSION
    controlnets: tuple[str, ...] = field(default=())
    # engines.yaml's `workflows:` (txt2img, img2img, inpaint, edit, img2vid); a repository packaged before they existed
    # has none recorded and serves txt2img, as it did
    workflows: tuple[str, ...] = field(default=DEFAULT_WORKFLOWS)
    # engines.yaml's `cfg:` (batched, split, parallel, none): `parallel` makes the entry issue a step's two CFG calls
    # at once, to the two instances its denoiser models were given. A repository packaged before it has none
    # recorded and picks its mode from the engine batches, as it did
    cfg: tuple[str, ...] = field(default=())
    # Qwen-Image: its engines' text_length (min, opt, max prompt tokens, engines.yaml's range), so the entry
    # truncates prompts where its encoder engine ends, as the in-process pipeline does; None: the family's default
    # range (and every other family, whose prompts are padded to one length)
    text_lengths: tuple[int, int, int] | None = None
    # engines.yaml's refit LoRAs: the names a request's LORAS may use (issue 28); none: every set but [] refused
    loras: tuple[str, ...] = ()
    # engines.yaml's step cache (step_cache.StepCache as JSON), where its pieces' engines were packaged; None: none
    step_cache: dict | None = None

    @property
    def step_cache_object(self) -> StepCache | None:
        if not self.step_cache:
            return None
        return StepCache(**{**self.step_cache, "method": StepCacheMethod(self.step_cache["method"])})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def write(self, folder: Path) -> None:
        (Path(folder) / FILE_NAME).write_text(self.to_json())

    @classmethod
    def read(cls, folder: Path) -> PipelineDescription:
        path = Path(folder) / FILE_NAME
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ServeError(f"cannot read {path}: {err}; package the repository again") from None
        if raw.get("schema_version") != SCHEMA_VERSION:
            raise ServeError(f"{path} has schema_version {raw.get('schema_version')!r}, this trt-diffusion reads "
                             f"{SCHEMA_VERSION}; package the repository again")

        def tensors(items) -> tuple[TensorSpec, ...]:
            return tuple(TensorSpec(t["dtype"], tuple(t["shape"]), t["name"]) for t in items)

        engines = tuple(EngineEntry(e["model"], e["component"], e["bucket"], e["batch"], e["controlnet"],
                                    tensors(e["inputs"]), tensors(e["outputs"]), tuple(e.get("loras") or ()))
                        for e in raw["engines"])
        return cls(raw["pipeline"], raw["family"], engines, raw["schema_version"], tuple(raw.get("controlnets", ())),
                   tuple(raw.get("workflows") or DEFAULT_WORKFLOWS), tuple(raw.get("cfg") or ()),
                   tuple(raw["text_lengths"]) if raw.get("text_lengths") else None, tuple(raw.get("loras") or ()),
                   raw.get("step_cache"))


def step_cache_json(cache: StepCache | None) -> dict | None:
    return None if cache is None else {**asdict(cache), "method": cache.method.value}
