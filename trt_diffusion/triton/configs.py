"""Model configs as protobuf messages (Triton's own schema), so what we write always parses; text in, text out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from ..errors import ServeError
from .contract import NUMPY_TO_TRITON, TensorDecl

ModelConfig = mc.ModelConfig
ROLE = "trt_diffusion_role"  # parameter naming what a model is for: entry | ensemble | stage | engine


# Triton's dynamic-batcher priority levels on a queued model (1 is served first): a request without `priority` —
# a person: generate, the OpenAI API's online routes — is interactive; the API's batch and video jobs send
# PRIORITY_BATCH, so queued jobs wait behind every queued person (a running job is not preempted: the API keeps
# jobs off a model's last instance, and the entry holds a job back between steps while a person's request runs on
# another instance: backend/activity.py, docs/deploy.md).
PRIORITY_INTERACTIVE = 1
PRIORITY_BATCH = 2


@dataclass(frozen=True)
class QueuePolicy:
    """Bounded queue in front of a model: overload is refused at once instead of waiting forever."""

    max_queue_size: int
    timeout_s: float  # longest wait in the queue before a request is rejected


@dataclass(frozen=True)
class WarmupSample:
    name: str
    shapes: dict[str, tuple[int, ...]]
    data_types: dict[str, str]


def triton_type(numpy_name: str, where: str) -> str:
    try:
        return NUMPY_TO_TRITON[numpy_name]
    except KeyError:
        raise ServeError(f"{where}: dtype {numpy_name!r} has no Triton data type") from None


def _add_tensors(target, decls: Iterable[TensorDecl], *, inputs: bool) -> None:
    for decl in decls:
        tensor = target.add()
        tensor.name = decl.name
        tensor.data_type = mc.DataType.Value(decl.data_type)
        tensor.dims.extend(decl.dims)
        if inputs and decl.optional:
            tensor.optional = True


def _parameters(config: ModelConfig, values: dict[str, str]) -> None:
    for key, value in values.items():
        config.parameters[key].string_value = value


def _instances(config: ModelConfig, count: int, kind: str, profiles: Sequence[str] = (),
               gpus: Sequence[int] = ()) -> None:
    """`profiles`: a multi-profile TensorRT plan's optimization profiles the instances may run in (Triton's
    TensorRT backend makes a context per profile listed and picks one by the request's shapes; left out, it uses
    profile 0 only). `gpus` (KIND_GPU): `count` instances on each GPU listed; none: on every GPU Triton sees."""
    group = config.instance_group.add()
    group.count = count
    group.kind = mc.ModelInstanceGroup.Kind.Value(kind)
    group.profile.extend(profiles)
    group.gpus.extend(gpus)


def _warmup(config: ModelConfig, samples: Sequence[WarmupSample], random_floats: bool) -> None:
    for sample in samples:
        warmup = config.model_warmup.add()
        warmup.name = sample.name
        warmup.batch_size = 1  # models with max_batch_size 0 take the full shape, batch_size must be 1
        for name, shape in sample.shapes.items():
            data = warmup.inputs[name]
            data.data_type = mc.DataType.Value(sample.data_types[name])
            data.dims.extend(shape)
            # Random token ids could index past an embedding table: integers are always zeros.
            if random_floats and sample.data_types[name] in ("TYPE_FP32", "TYPE_FP16", "TYPE_BF16"):
                data.random_data = True
            else:
                data.zero_data = True


PLAN_PLATFORM = "tensorrt_plan"  # Triton names TensorRT plans as a platform, not a backend


def engine_config(name: str, *, inputs: Sequence[TensorDecl], outputs: Sequence[TensorDecl], backend: str,
                  model_file: str | None, instances: int, kind: str, warmup: Sequence[WarmupSample],
                  random_warmup: bool, parameters: dict[str, str], profiles: Sequence[str] = (),
                  gpus: Sequence[int] = ()) -> ModelConfig:
    """One engine: `backend` is a Triton backend (python, onnxruntime, openvino, ...) or the platform
    tensorrt_plan, as the engine's target says; `model_file` the file a non-python backend loads; `profiles` the
    optimization profiles of a multi-profile plan its instances run in; `gpus` the GPUs of a KIND_GPU model's
    instances."""
    config = ModelConfig(name=name, max_batch_size=0)  # the engine's batch is part of its shape
    if backend == PLAN_PLATFORM:
        config.platform = backend
    else:
        config.backend = backend
    if backend != "python" and model_file:
        config.default_model_filename = model_file
    _add_tensors(config.input, inputs, inputs=True)
    _add_tensors(config.output, outputs, inputs=False)
    _instances(config, instances, kind, profiles, gpus)
    _warmup(config, warmup, random_warmup)
    _parameters(config, {ROLE: "engine", **parameters})
    return config


def pipeline_config(name: str, *, stage: str, inputs: Sequence[TensorDecl], outputs: Sequence[TensorDecl],
                    instances: int, queue: QueuePolicy | None, parameters: dict[str, str],
                    batch_requests: int = 1, batch_delay_us: int = 0) -> ModelConfig:
    """`batch_requests` > 1 (the entry): Triton's dynamic batcher hands one execute up to that many requests,
    waiting at most `batch_delay_us` for partners; the model groups them (see pipeline_model)."""
    config = ModelConfig(name=name, backend="python", max_batch_size=max(1, batch_requests))
    _add_tensors(config.input, inputs, inputs=True)
    _add_tensors(config.output, outputs, inputs=False)
    _instances(config, instances, "KIND_CPU")
    if queue is not None:
        batching = config.dynamic_batching
        batching.max_queue_delay_microseconds = batch_delay_us if batch_requests > 1 else 0
        policy = batching.default_queue_policy
        policy.timeout_action = mc.ModelQueuePolicy.TimeoutAction.Value("REJECT")
        policy.default_timeout_microseconds = int(queue.timeout_s * 1e6)
        policy.allow_timeout_override = True  # a client may ask for a shorter wait
        policy.max_queue_size = queue.max_queue_size
        batching.priority_levels = PRIORITY_BATCH
        batching.default_priority_level = PRIORITY_INTERACTIVE
    if stage == "stream":  # one request, many responses (previews, then the image): gRPC streaming
        config.model_transaction_policy.decoupled = True
    role = {"full": "entry", "stream": "stream"}.get(stage, "stage")
    _parameters(config, {ROLE: role, "stage": stage, **parameters})
    return config


@dataclass(frozen=True)
class EnsembleStep:
    model: str
    input_map: dict[str, str]  # model input -> ensemble tensor
    output_map: dict[str, str]  # model output -> ensemble tensor


def ensemble_config(name: str, *, inputs: Sequence[TensorDecl], outputs: Sequence[TensorDecl],
                    steps: Sequence[EnsembleStep], parameters: dict[str, str]) -> ModelConfig:
    config = ModelConfig(name=name, platform="ensemble", max_batch_size=1)
    _add_tensors(config.input, inputs, inputs=True)
    _add_tensors(config.output, outputs, inputs=False)
    for step in steps:
        proto = config.ensemble_scheduling.step.add()
        proto.model_name = step.model
        proto.model_version = -1
        proto.input_map.update(step.input_map)
        proto.output_map.update(step.output_map)
    _parameters(config, {ROLE: "ensemble", **parameters})
    return config


def to_text(config: ModelConfig) -> str:
    return text_format.MessageToString(config)


def parse(text: str, where: str) -> ModelConfig:
    config = ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as err:
        raise ServeError(f"{where}: config.pbtxt does not parse as a Triton ModelConfig: {err}") from None
    return config


def type_name(data_type: int) -> str:
    return mc.DataType.Name(data_type)
