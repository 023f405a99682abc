"""Ask a Triton server for an image, over HTTP or gRPC, with the server's own words when it refuses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ServeError
from ..families import request_inputs_of_all
from . import contract
from .client_limits import (  # noqa: F401  (RequestRejected, RequestCancelled, malformed: re-exported)
    MAX_RESPONSE_BYTES,
    Deadline,
    RequestCancelled,
    RequestRejected,
    cap_responses,
    check_input_image,
    check_served_size,
    malformed,
    remaining,
)
from .client_limits import deadline as deadline_context
from .configs import ROLE

PROTOCOLS = ("http", "grpc")


def deadline(timeout_s: float, url: str, what: str = "the request"):
    """client_limits.deadline, as preflight imports it from here (functions below take a Deadline as `deadline`)."""
    return deadline_context(timeout_s, url, what)
_WORKFLOW_INPUTS = tuple(t.name for t in contract.WORKFLOW_INPUTS)
_TYPES = {t.name: contract.TRITON_TO_WIRE[t.data_type]
          for t in (*contract.request_inputs(True), *contract.family_inputs(), contract.NUM_IMAGES,
                    contract.PREVIEW_EVERY)}


@dataclass(frozen=True)
class ImageRequest:
    prompt: str
    height: int
    width: int
    steps: int = 20
    guidance_scale: float = 7.5
    seed: int = 0
    negative_prompt: str | None = None
    scheduler: str | None = None
    controlnet: str | None = None
    control_image: np.ndarray | None = None  # uint8 [H, W, 3]
    controlnet_scale: float | None = None
    num_images: int | None = None  # None: one image, NUM_IMAGES not sent (servers before NUM_IMAGES accept it)
    # Image-conditioned workflows (docs/triton.md): None leaves the input out (servers before them accept it)
    workflow: str | None = None  # txt2img | img2img | inpaint | edit | img2vid; None: what init_image / mask /
    # frames imply (an init_image with frames: img2vid, the image as the clip's first frame)
    init_image: np.ndarray | None = None  # uint8 [H, W, 3], the request's size (the server never resizes)
    mask: np.ndarray | None = None  # uint8 [H, W], white (>= 128) is repainted
    strength: float | None = None  # (0, 1]; None: the workflow's default (img2img 0.8, inpaint 1.0)
    # Video models (FRAMES set): the answer is VIDEO uint8 [N, F, H, W, 3]
    frames: int | None = None  # 4k+1 for Wan
    guidance_scale_2: float | None = None  # Wan 2.2's low-noise expert; None: guidance_scale
    # Qwen-Image: prompt tokens kept after the template (MAX_SEQUENCE_LENGTH); None: left out, the server's default
    max_sequence_length: int | None = None
    # LoRA per request: LORAS as JSON ([{"name": "style", "scale": 0.8}, ...]); None: left out, the base model
    loras: str | None = None
    # "on" | "off" (STEP_CACHE); None: left out, engines.yaml's step_cache.enabled
    step_cache: str | None = None
    # the inputs the model's family adds (families/<name>.py `request_inputs`), by diffusers' argument:
    # {"cfg_truncation": 0.5} is sent as CFG_TRUNCATION; None or left out: the family's defaults (diffusers')
    inputs: Mapping[str, float] | None = None

    @property
    def result(self) -> str:
        """The output that carries the answer: VIDEO for a video request, IMAGE otherwise."""
        return (contract.VIDEO if self.frames else contract.IMAGE).name

    def tensors(self) -> dict[str, np.ndarray]:
        """Request tensors with their batch dimension of 1; optional ones only when set."""
        def text(value: str) -> np.ndarray:
            return np.array([[value.encode("utf-8")]], dtype=object)

        values = {
            "PROMPT": text(self.prompt), "HEIGHT": np.array([[self.height]], np.int32),
            "WIDTH": np.array([[self.width]], np.int32), "STEPS": np.array([[self.steps]], np.int32),
            "GUIDANCE_SCALE": np.array([[self.guidance_scale]], np.float32), "SEED": np.array([[self.seed]], np.int64),
        }
        if self.negative_prompt is not None:
            values["NEGATIVE_PROMPT"] = text(self.negative_prompt)
        if self.scheduler is not None:
            values["SCHEDULER"] = text(self.scheduler)
        if self.controlnet is not None:
            values["CONTROLNET"] = text(self.controlnet)
        if self.control_image is not None:
            values["CONTROL_IMAGE"] = np.ascontiguousarray(self.control_image, dtype=np.uint8)[None]
        if self.controlnet_scale is not None:
            values["CONTROLNET_SCALE"] = np.array([[self.controlnet_scale]], np.float32)
        if self.num_images is not None:
            values["NUM_IMAGES"] = np.array([[self.num_images]], np.int32)
        if self.workflow is not None:
            values["WORKFLOW"] = text(self.workflow)
        if self.init_image is not None:
            values["INIT_IMAGE"] = check_input_image("INIT_IMAGE", self.init_image, 3)[None]
        if self.mask is not None:
            values["MASK"] = check_input_image("MASK", self.mask, None)[None]
        if self.strength is not None:
            values["STRENGTH"] = np.array([[self.strength]], np.float32)
        if self.frames is not None:
            values["FRAMES"] = np.array([[self.frames]], np.int32)
        if self.guidance_scale_2 is not None:
            values["GUIDANCE_SCALE_2"] = np.array([[self.guidance_scale_2]], np.float32)
        if self.max_sequence_length is not None:
            values["MAX_SEQUENCE_LENGTH"] = np.array([[self.max_sequence_length]], np.int32)
        if self.loras is not None:
            values["LORAS"] = text(self.loras)
        if self.step_cache is not None:
            values["STEP_CACHE"] = text(self.step_cache)
        values.update(family_input_tensors(self.inputs or {}))
        return values


def family_input_tensors(inputs: Mapping[str, float]) -> dict[str, np.ndarray]:
    """A request's family inputs as their tensors ({"cfg_truncation": 0.5} -> CFG_TRUNCATION FP32 [[0.5]]). An
    argument no family declares is refused here by name; the value's range is the serving model's to check."""
    known = request_inputs_of_all()
    values = {}
    for argument, value in inputs.items():
        declared = known.get(argument)
        if declared is None:
            raise ServeError(f"{argument!r} is not a request input of any family (declared: "
                             f"{', '.join(sorted(known)) or 'none'})")
        try:
            number = declared.data_type(value)
        except (TypeError, ValueError):
            raise ServeError(f"{declared.name} must be a number, got {value!r}") from None
        values[declared.name] = np.array([[number]], np.int32 if declared.data_type is int else np.float32)
    return values


def client_module(protocol: str):
    if protocol == "http":
        import tritonclient.http as module
    elif protocol == "grpc":
        import tritonclient.grpc as module
    else:
        raise ServeError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    return module


def strip_scheme(url: str) -> str:
    """tritonclient wants host:port; accept http://host:port too."""
    return parse_url(url)[0]


# scheme -> (TLS?, protocols it may carry). No scheme: plain text, as tritonclient's own default.
_SCHEMES = {"http": (False, ("http", "grpc")), "https": (True, ("http", "grpc")),
            "grpc": (False, ("grpc",)), "grpcs": (True, ("grpc",))}


def parse_url(url: str, protocol: str | None = None) -> tuple[str, bool]:
    """(host:port[/path], TLS?) of a server URL. https:// and grpcs:// mean TLS, with certificates verified;
    a scheme this client cannot honour is refused rather than silently sent as plain text."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.rstrip("/"), False
    if scheme.lower() not in _SCHEMES:
        raise ServeError(f"--url {url}: unknown scheme {scheme}://; use host:port, http://, https://, grpc:// "
                         "or grpcs://")
    tls, protocols = _SCHEMES[scheme.lower()]
    if protocol is not None and protocol not in protocols:
        raise ServeError(f"--url {url}: a {scheme}:// address does not speak {protocol}; use --protocol "
                         f"{protocols[0]} or another URL")
    rest = rest.rstrip("/")
    if protocol == "grpc" and "/" in rest:
        raise ServeError(f"--url {url}: a gRPC address is host:port, without a path")
    if not rest:
        raise ServeError(f"--url {url}: no host:port")
    return rest, tls


def make_inputs(module, tensors: dict[str, np.ndarray]) -> list:
    inputs = []
    for name, value in tensors.items():
        tensor = module.InferInput(name, list(value.shape), _TYPES.get(name, "BYTES"))
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def connect(url: str, protocol: str = "http", timeout_s: float = 300.0, max_response_bytes: int = MAX_RESPONSE_BYTES,
            *, deadline: Deadline | None = None):
    """An open client. `deadline`: the HTTP client's connect and reads get at most what is left of it (a gRPC
    channel connects lazily, within each call's own client_timeout)."""
    module = client_module(protocol)
    address, tls = parse_url(url, protocol)
    if deadline is not None:
        timeout_s = deadline.left("connecting")
    if protocol == "http":
        tls_options = {}
        if tls:  # verify the certificate and the host name (tritonclient's bare default wraps without a context)
            import gevent.ssl

            tls_options = {"ssl": True, "ssl_context_factory": gevent.ssl.create_default_context}
        # network_timeout bounds one read; `deadline` bounds the whole exchange
        client = module.InferenceServerClient(address, connection_timeout=min(timeout_s, 60.0),
                                              network_timeout=timeout_s, **tls_options)
        cap_responses(client, url, max_response_bytes)
        return client
    # gRPC TLS: the system's root certificates; replies above the cap are refused by gRPC itself
    return module.InferenceServerClient(address, ssl=tls, channel_args=[
        ("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", max_response_bytes)])


def server_error(err: Exception, url: str, pipeline: str) -> ServeError:
    """tritonclient's exception as one of ours, keeping the server's message."""
    message = err.message() if hasattr(err, "message") and callable(err.message) else str(err)
    status = str(err.status()) if hasattr(err, "status") and callable(err.status) else ""
    message = message.removeprefix(f"{pipeline}: ")  # the entry model names itself already
    text = f"Triton at {url}, model {pipeline}: {message or status or err}"
    lowered = f"{message} {status}".lower()
    if "exceeds maximum queue size" in lowered or "request timeout expired" in lowered:
        return RequestRejected(text)
    if "cancel" in lowered or "deadline" in lowered:
        return RequestCancelled(text)
    wrong_port = _wrong_port(lowered, url)
    if wrong_port:
        return ServeError(wrong_port)
    if "unexpected inference input 'controlnet" in lowered:
        return ServeError(f"Triton at {url}: model {pipeline} serves no ControlNet (package a model with "
                          "`controlnets:` in engines.yaml); leave out --controlnet and --control-image")
    if any(f"unexpected inference input '{name.lower()}'" in lowered for name in _WORKFLOW_INPUTS):
        return ServeError(f"Triton at {url}: model {pipeline} takes no {'/'.join(_WORKFLOW_INPUTS)} (a repository "
                          "packaged before image-conditioned workflows): package it again, with `workflows:` in "
                          "engines.yaml")
    if isinstance(err, OSError) or "failed to connect" in lowered or "connection refused" in lowered:
        return ServeError(f"cannot reach Triton at {url} ({message or err}); is `trt-diffusion serve` running?")
    return ServeError(text)


def _wrong_port(lowered: str, url: str) -> str | None:
    """The message for a client speaking the other protocol than the port it reached (8000 HTTP, 8001 gRPC)."""
    if "expected http/" in lowered:  # an HTTP client on the gRPC port: the reply is HTTP/2 frames
        return (f"the server at {url} did not answer HTTP/1.1: is that Triton's gRPC port (8001 by default)? Use "
                f"--url grpc://{strip_scheme(url)}, or the HTTP port (8000)")
    grpc_refused = "http1.x server" in lowered or ("unavailable" in lowered and "socket closed" in lowered)
    if grpc_refused and _answers_http(url):  # gRPC on the HTTP port: the connection is taken, then closed
        return (f"the server at {url} answered HTTP/1.1, not gRPC: is that Triton's HTTP port (8000 by default)? "
                f"Use --url http://{strip_scheme(url)}, or the gRPC port (8001)")
    return None


def _answers_http(url: str) -> bool:
    """Whether something at `url` answers a plain HTTP/1.1 request (one short probe, 2 s at most)."""
    import http.client

    host, _, port = strip_scheme(url).rpartition(":")
    try:
        connection = http.client.HTTPConnection(host or "127.0.0.1", int(port), timeout=2)
        try:
            connection.request("GET", "/v2/health/live")
            return connection.getresponse().status > 0
        finally:
            connection.close()
    except (OSError, ValueError, http.client.HTTPException):
        return False


def _timeout(deadline: Deadline | None, protocol: str | None, what: str = "the request") -> dict:
    """The keyword a call takes its share of the deadline by: gRPC's client_timeout (HTTP is bounded by
    Deadline.bounded's timer). Raises the deadline's error once nothing is left: no call is made then."""
    if deadline is None:
        return {}
    left = deadline.left(what)
    return {"client_timeout": left} if protocol == "grpc" else {}


def unknown_pipeline(client, url: str, pipeline: str, *, deadline: Deadline | None = None,
                     protocol: str | None = None) -> ServeError | None:
    """When `pipeline` is not a model the server has, the message that lists the pipelines it serves."""
    timeout = _timeout(deadline, protocol)
    try:
        index = client.get_model_repository_index(**timeout)
    except Exception:  # noqa: BLE001 - the original error stands
        if deadline is not None and deadline.passed():
            raise deadline.expired() from None
        return None
    try:
        names = _model_names(index, url)
    except ServeError:
        return None
    if pipeline in names:
        return None
    entries = [name for name in names if _role(client, name, deadline, protocol) == "entry"]
    return ServeError(f"Triton at {url} serves no pipeline {pipeline!r}; it serves: {', '.join(entries) or 'none'}")


def infer(client, module, pipeline: str, request: ImageRequest, *, protocol: str, timeout_s: float,
          url: str = "") -> np.ndarray:
    """One request on an open client. Returns the image, uint8 [H, W, 3]."""
    return infer_images(client, module, pipeline, request, protocol=protocol, timeout_s=timeout_s, url=url,
                        timing=False)[0][0]


def infer_images(client, module, pipeline: str, request: ImageRequest, *, protocol: str, timeout_s: float,
                 url: str = "", timing: bool = True, deadline: Deadline | None = None) -> tuple[np.ndarray, dict]:
    """(images uint8 [N, H, W, 3] with N = NUM_IMAGES — videos [N, F, H, W, 3] for a FRAMES request — the
    response parameters: `timing` decoded from JSON).
    `timing`: also ask for the TIMING output (models without it, the ensemble, are asked again without).
    `deadline`: a gRPC call gets what is left of it (each call, the retry without TIMING too)."""
    import time

    if deadline is not None:
        timeout_s = deadline.left()
    inputs = make_inputs(module, request.tensors())
    result_name = request.result
    names = [result_name, "TIMING"] if timing else [result_name]
    outputs = [module.InferRequestedOutput(name) for name in names]
    parameters = {contract.SENT_NS_PARAMETER: time.time_ns()}  # the server reports queue_s from it
    try:
        if protocol == "grpc":
            result = client.infer(pipeline, inputs, outputs=outputs, client_timeout=timeout_s, parameters=parameters)
        else:
            result = client.infer(pipeline, inputs, outputs=outputs, parameters=parameters)
    except ServeError:
        raise
    except Exception as err:  # noqa: BLE001 - tritonclient raises InferenceServerException, sockets raise OS errors
        if not request.frames and f"unexpected inference output '{contract.IMAGE.name}'" in str(err):
            raise ServeError(f"Triton at {url}, model {pipeline} serves video: send FRAMES (generate --frames; "
                             "4k+1 for Wan)") from None
        if timing and "unexpected inference output 'TIMING'" in str(err):
            return infer_images(client, module, pipeline, request, protocol=protocol, timeout_s=timeout_s, url=url,
                                timing=False, deadline=deadline)
        if isinstance(err, (ValueError, KeyError, TypeError)):
            raise malformed(url, f"the request to {pipeline}", err) from None
        raise server_error(err, url, pipeline) from None
    try:
        images = result.as_numpy(result_name)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise malformed(url, f"the request to {pipeline} ({result_name})", exc) from None
    expected = request.num_images or 1
    rank, dims = (5, "F, H, W, 3") if request.frames else (4, "H, W, 3")
    if (images is None or images.ndim != rank or images.shape[0] != expected or images.shape[-1] != 3
            or images.dtype != np.uint8):
        raise ServeError(f"Triton at {url}, model {pipeline}: expected {result_name} uint8 [{expected}, {dims}], "
                         f"got {None if images is None else (images.dtype, list(images.shape))}")
    try:
        return images, response_parameters(result.get_response(), result)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise malformed(url, f"the request to {pipeline} (parameters)", exc) from None


def response_parameters(response: Any, result: Any = None) -> dict:
    """A response's parameters as a dict (HTTP: JSON; gRPC: InferParameter messages), `timing` parsed: from the
    TIMING output where the server sends one (Triton 2.51's python backend cannot set response parameters)."""
    import json

    if isinstance(response, dict):
        values = dict(response.get("parameters") or {})
    else:
        values = {}
        for key, parameter in response.parameters.items():
            kind = parameter.WhichOneof("parameter_choice")
            values[key] = getattr(parameter, kind) if kind else None
    timing = result.as_numpy("TIMING") if result is not None else None
    if timing is not None and timing.size:
        item = timing.reshape(-1)[0]
        values[contract.TIMING_PARAMETER] = item.decode() if isinstance(item, bytes) else str(item)
    if isinstance(values.get(contract.TIMING_PARAMETER), str):
        values[contract.TIMING_PARAMETER] = json.loads(values[contract.TIMING_PARAMETER])
    return values


def generate(url: str, *, pipeline: str | None = None, prompt: str, height: int, width: int, steps: int = 20,
             guidance_scale: float = 7.5, seed: int = 0, negative_prompt: str | None = None,
             scheduler: str | None = None, controlnet: str | None = None, control_image: np.ndarray | None = None,
             controlnet_scale: float | None = None, protocol: str = "http", timeout_s: float = 300.0,
             workflow: str | None = None, init_image: np.ndarray | None = None, mask: np.ndarray | None = None,
             strength: float | None = None) -> np.ndarray:
    """Generate one image on a Triton server; uint8 [H, W, 3]. `pipeline` None: the server's only pipeline.
    `init_image` (img2img; with `mask`, inpaint) is the request's size: the server never resizes."""
    module = client_module(protocol)
    request = ImageRequest(prompt, height, width, steps, guidance_scale, seed, negative_prompt, scheduler,
                           controlnet, control_image, controlnet_scale, workflow=workflow, init_image=init_image,
                           mask=mask, strength=strength)
    bound = Deadline(timeout_s, url)
    client = connect(url, protocol, deadline=bound)
    try:
        with bound.bounded():
            pipeline = pipeline or find_pipeline(client, url, deadline=bound, protocol=protocol)
            return infer_images(client, module, pipeline, request, protocol=protocol, timeout_s=timeout_s, url=url,
                                timing=False, deadline=bound)[0][0]
    finally:
        client.close()


def generate_images(url: str, request: ImageRequest, *, pipeline: str | None = None, protocol: str = "http",
                    timeout_s: float = 300.0, deadline: Deadline | None = None) -> tuple[np.ndarray, dict]:
    """(images uint8 [N, H, W, 3], response parameters with `timing`) for one request (NUM_IMAGES = N).
    `deadline`: the command's, shared with what it did before (size discovery); else one of `timeout_s`."""
    module = client_module(protocol)
    bound = deadline or Deadline(timeout_s, url)
    client = connect(url, protocol, deadline=bound)
    try:
        named = pipeline is not None
        with bound.bounded():
            pipeline = pipeline or find_pipeline(client, url, deadline=bound, protocol=protocol)
            try:
                return infer_images(client, module, pipeline, request, protocol=protocol, timeout_s=timeout_s,
                                    url=url, deadline=bound)
            except RequestCancelled:
                raise
            except ServeError as err:
                unknown = unknown_pipeline(client, url, pipeline, deadline=bound, protocol=protocol) \
                    if named and "unknown model" in str(err).lower() else None
                if unknown is not None:
                    raise unknown from None
                raise
    finally:
        client.close()


def stream(url: str, request: ImageRequest, *, model: str, preview_every: int | None = None,
           timeout_s: float = 300.0, on_preview=None) -> tuple[np.ndarray, list[tuple[int, np.ndarray]], dict]:
    """Over gRPC, the streaming entry `<pipeline>_stream`: (image [H, W, 3], previews [(step, uint8 [h, w, 3])],
    response parameters); a video request: (video [F, H, W, 3], previews [(step, uint8 [f, h, w, 3])], ...). `on_preview(step, preview)` is called as each arrives; returning False cancels."""
    import queue
    import time

    import tritonclient.grpc as grpc

    tensors = request.tensors()
    if preview_every is not None:
        tensors["PREVIEW_EVERY"] = np.array([[preview_every]], np.int32)
    inputs = make_inputs(grpc, tensors)
    results: queue.Queue = queue.Queue()
    client = grpc.InferenceServerClient(strip_scheme(url), channel_args=[
        ("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)])
    previews: list[tuple[int, np.ndarray]] = []
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)),
                            stream_timeout=timeout_s)
        client.async_stream_infer(model, inputs, enable_empty_final_response=True,
                                  parameters={contract.SENT_NS_PARAMETER: time.time_ns()})
        image, parameters = None, {}
        while True:
            try:
                result, error = results.get(timeout=timeout_s)
            except queue.Empty:
                raise RequestCancelled(f"Triton at {url}, model {model}: no response for {timeout_s:.0f} s") from None
            if error is not None:
                raise server_error(error, url, model)
            response = result.get_response()
            final = "triton_final_response" in response.parameters and response.parameters[
                "triton_final_response"].bool_param
            if final and not response.outputs:
                break
            preview = result.as_numpy("PREVIEW")
            if preview is not None and preview.size:
                step = int(result.as_numpy("STEP").reshape(-1)[0])
                previews.append((step, preview[0]))
                if on_preview is not None and on_preview(step, preview[0]) is False:
                    client.stop_stream(cancel_requests=True)
                    raise RequestCancelled(f"Triton at {url}, model {model}: cancelled after step {step}")
                continue
            image = result.as_numpy(request.result)
            parameters = response_parameters(response, result)
            if final:
                break
        if image is None:
            raise ServeError(f"Triton at {url}, model {model}: the stream ended without an image")
        return image[0], previews, parameters
    finally:
        try:
            client.stop_stream()
        except Exception:  # noqa: BLE001 - already stopped
            pass
        client.close()


def find_pipeline(client, url: str, *, deadline: Deadline | None = None, protocol: str | None = None) -> str:
    """The one entry model (parameter trt_diffusion_role = entry) the server has loaded. `deadline` with
    `protocol` grpc: each call's client_timeout is what is left of it."""
    timeout = _timeout(deadline, protocol)
    try:
        index = client.get_model_repository_index(**timeout)
    except Exception as err:  # noqa: BLE001
        if deadline is not None and deadline.passed():
            raise deadline.expired() from None
        raise server_error(err, url, "(repository index)") from None
    names = _model_names(index, url)
    entries = [name for name in names if _role(client, name, deadline, protocol) == "entry"]
    if len(entries) != 1:
        listed = ", ".join(entries) or "none"
        raise ServeError(f"Triton at {url} serves {len(entries)} trt-diffusion pipelines ({listed})"
                         "; name one with --pipeline")
    return entries[0]


def _index_models(index: Any) -> list:
    return list(index.models) if hasattr(index, "models") else list(index)


def _model_names(index: Any, url: str) -> list[str]:
    """The model names of a repository index reply; ServeError when it is not one."""
    try:
        names = [m["name"] if isinstance(m, dict) else m.name for m in _index_models(index)]
    except (KeyError, TypeError, AttributeError) as exc:
        raise malformed(url, "the repository index", exc) from None
    if not all(isinstance(n, str) for n in names):
        raise malformed(url, "the repository index", TypeError("a model name is not a string"))
    return names


def _parameter(client, model: str, key: str, deadline: Deadline | None = None, protocol: str | None = None) -> str:
    timeout = _timeout(deadline, protocol)
    try:
        config = client.get_model_config(model, **timeout)
    except Exception:  # noqa: BLE001 - a model that failed to load has no config to read
        if deadline is not None and deadline.passed():  # not a model without config: no answer in time
            raise deadline.expired() from None
        return ""
    if isinstance(config, dict):  # HTTP: JSON
        parameters = config.get("parameters", {})
        entry = parameters.get(key, {}) if isinstance(parameters, dict) else {}
        value = entry.get("string_value", "") if isinstance(entry, dict) else ""
        return value if isinstance(value, str) else ""  # a malformed config reads as no parameter
    parameters = config.config.parameters  # gRPC: ModelConfigResponse
    return parameters[key].string_value if key in parameters else ""


def _role(client, name: str, deadline: Deadline | None = None, protocol: str | None = None) -> str:
    return _parameter(client, name, ROLE, deadline, protocol)


def served_sizes(url: str, pipeline: str | None = None, protocol: str = "http", *,
                 deadline: Deadline | None = None) -> tuple[str, list[str]]:
    """(pipeline, sizes to ask for: one per bucket) as the server's entry model declares them. `deadline`: the
    command's (generate --timeout), which the request after this shares; else 60 s."""
    bound = deadline or Deadline(60.0, url)
    client = connect(url, protocol, deadline=bound)
    try:
        with bound.bounded("reading the served sizes"):
            if pipeline is not None and (unknown := unknown_pipeline(client, url, pipeline, deadline=bound,
                                                                     protocol=protocol)) is not None:
                raise unknown
            pipeline = pipeline or find_pipeline(client, url, deadline=bound, protocol=protocol)
            sizes = [s for s in _parameter(client, pipeline, "request_sizes", bound, protocol).split(";") if s]
    finally:
        client.close()
    if not sizes:
        raise ServeError(f"Triton at {url}: model {pipeline} declares no sizes; is it a trt-diffusion pipeline?")
    for label in sizes:
        check_served_size(label, url, pipeline)
    return pipeline, sizes
