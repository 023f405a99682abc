"""A stand-in Triton that answers ModelInfer, for the job tests of the OpenAI API: a real gRPC server (grpcio,
Triton's own service definition) serving two image entries, whose IMAGE is a deterministic function of the request
(model, prompt, negative prompt, steps, guidance, LoRAs, size and each image's seed). So a batch line's image can be
compared with the same request sent online, image for image, without an engine; every inference is logged, and a
test can hold inferences at a gate (to cancel one, or to kill the API in the middle of a batch). An image entry
serves edits too (its image then a function of the input image, mask and strength as well); the video entry has its
decoupled stream model (`wan-tiny_stream`, unless `video_stream` is False): a STEP message every PREVIEW_EVERY
steps, each of which a test can hold at `step_gate`, then the clip the entry gives."""

from __future__ import annotations

import hashlib
import struct
import threading
from concurrent import futures
from dataclasses import dataclass, field

import numpy as np

ENTRIES = {"sd15-tiny": "64x64;32x48", "sdxl-tiny": "64x64"}  # name -> request_sizes
VIDEO_ENTRIES = {"wan-tiny": "32x32x5;32x32x17;48x32x5"}  # a video entry: WxHxF
STREAM = "_stream"  # the video entry's stream model: its name with this suffix
INPUTS = ("PROMPT", "NEGATIVE_PROMPT", "HEIGHT", "WIDTH", "STEPS", "GUIDANCE_SCALE", "SEED", "NUM_IMAGES",
          "WORKFLOW", "INIT_IMAGE", "MASK", "STRENGTH", "LORAS")
_DTYPES = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "UINT8": np.uint8}


def expected_image(model: str, prompt: str, seed: int, height: int, width: int, steps: int = 20,
                   guidance: float = 7.5, negative: str | None = None, loras: str | None = None,
                   init_image: np.ndarray | None = None, mask: np.ndarray | None = None,
                   strength: float | None = None) -> np.ndarray:
    """The image the stub makes for one seed of a request (an edit: of its INIT_IMAGE, MASK and STRENGTH too)."""
    key = repr((model, prompt, negative, steps, round(float(guidance), 4), loras, height, width, seed)).encode()
    if init_image is not None:
        edit = [np.ascontiguousarray(init_image, np.uint8).tobytes(),
                b"" if mask is None else np.ascontiguousarray(mask, np.uint8).tobytes(),
                repr(None if strength is None else round(float(strength), 4)).encode()]
        key += hashlib.sha256(b"|".join(edit)).digest()
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
    return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


def expected_clip(model: str, prompt: str, seed: int, height: int, width: int, frames: int, steps: int = 20,
                  guidance: float = 5.0, negative: str | None = None, init_image: np.ndarray | None = None
                  ) -> np.ndarray:
    """The clip the stub makes for a video request: smooth frames (they survive H.264 nearly unchanged)."""
    reference = None if init_image is None else hashlib.sha256(init_image.tobytes()).hexdigest()
    key = repr((model, prompt, negative, steps, round(float(guidance), 4), height, width, frames, seed,
                reference)).encode()
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
    colours = rng.integers(0, 256, (frames, 1, 1, 3))
    ramp = np.linspace(0, 60, width)[None, None, :, None]
    return np.clip(colours + ramp, 0, 255).astype(np.uint8) * np.ones((1, height, 1, 1), np.uint8)


def _decode(tensor, raw: bytes):
    if tensor.datatype == "BYTES":
        values, offset = [], 0
        while offset < len(raw):
            (size,) = struct.unpack_from("<I", raw, offset)
            values.append(raw[offset + 4: offset + 4 + size].decode())
            offset += 4 + size
        return values[0]
    return np.frombuffer(raw, _DTYPES[tensor.datatype]).reshape(list(tensor.shape))


@dataclass
class ImagesStub:
    url: str = ""
    infers: list = field(default_factory=list)  # (model, prompt, seed) of every inference that answered
    gate: threading.Semaphore | None = None  # set: each inference takes a permit first (a test releases them)
    entered: threading.Event = field(default_factory=threading.Event)  # an inference reached the gate
    cancelled: threading.Event = field(default_factory=threading.Event)  # a held inference's client cancelled it
    arrivals: int = 0  # inferences that reached the stub (held ones included)
    arrived: list = field(default_factory=list)  # (model, prompt, seed) of each of them
    priorities: dict = field(default_factory=dict)  # prompt -> the request's priority (0: none sent)
    marks: dict = field(default_factory=dict)  # prompt -> its trt_diffusion_priority parameter ("": none sent)
    instances: int = 2  # each entry's instance count, as its config declares it
    video_stream: bool = True  # the video entry's stream model is served (listed and answered)
    step_gate: threading.Semaphore | None = None  # set: each STEP message of a stream takes a permit first
    steps_sent: list = field(default_factory=list)  # the STEP of every stream message sent
    unavailable: int = 0  # the next this many inferences answer UNAVAILABLE (Triton went away)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: object = None

    def stop(self) -> None:
        if self.gate is not None:
            self.gate.release(1000)  # let held calls end so the server stops at once
        self.server.stop(grace=None)


def start_images_stub(port: int = 0) -> ImagesStub:
    import grpc
    from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

    from trt_diffusion.triton.configs import ROLE

    stub = ImagesStub()

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ServerLive(self, request, context):
            return service_pb2.ServerLiveResponse(live=True)

        def ServerReady(self, request, context):  # the API's probe of a replica it marked down
            return service_pb2.ServerReadyResponse(ready=True)

        def RepositoryIndex(self, request, context):
            return service_pb2.RepositoryIndexResponse(models=[
                service_pb2.RepositoryIndexResponse.ModelIndex(name=name, version="1", state="READY")
                for name in (*ENTRIES, *VIDEO_ENTRIES, *([f"{v}{STREAM}" for v in VIDEO_ENTRIES]
                                                         if stub.video_stream else []))])

        def ModelConfig(self, request, context):
            if request.name.removesuffix(STREAM) in VIDEO_ENTRIES and request.name.endswith(STREAM):
                parameters = {ROLE: "stream", "family": "wan", "request_sizes": VIDEO_ENTRIES[request.name[
                    :-len(STREAM)]], "max_images": "1", "workflows": "txt2img;img2vid"}
            elif request.name in VIDEO_ENTRIES:
                parameters = {ROLE: "entry", "family": "wan", "request_sizes": VIDEO_ENTRIES[request.name],
                              "max_images": "1", "workflows": "txt2img;img2vid"}
            else:
                parameters = {ROLE: "entry", "family": "sd15", "request_sizes": ENTRIES[request.name],
                              "max_images": "4", "workflows": "txt2img;img2img;inpaint"}
            config = model_config_pb2.ModelConfig(
                name=request.name, input=[model_config_pb2.ModelInput(name=name) for name in INPUTS],
                instance_group=[model_config_pb2.ModelInstanceGroup(count=stub.instances)],
                parameters={k: model_config_pb2.ModelParameter(string_value=v) for k, v in parameters.items()})
            return service_pb2.ModelConfigResponse(config=config)

        def ModelInfer(self, request, context):
            values = {t.name: _decode(t, raw) for t, raw in zip(request.inputs, request.raw_input_contents,
                                                                 strict=True)}
            with stub.lock:
                stub.arrivals += 1
                stub.arrived.append((request.model_name, values["PROMPT"], int(values["SEED"].reshape(-1)[0])))
                priority = request.parameters["priority"].uint64_param if "priority" in request.parameters else 0
                stub.priorities[values["PROMPT"]] = priority
                stub.marks[values["PROMPT"]] = request.parameters["trt_diffusion_priority"].string_param \
                    if "trt_diffusion_priority" in request.parameters else ""
            stub.entered.set()
            if stub.gate is not None:
                while not stub.gate.acquire(timeout=0.05):
                    if not context.is_active():  # the client cancelled while held: nothing is answered
                        stub.cancelled.set()
                        return service_pb2.ModelInferResponse()
            with stub.lock:
                if stub.unavailable > 0:
                    stub.unavailable -= 1
                    context.abort(grpc.StatusCode.UNAVAILABLE, "stub triton: the server went away")
            scalar = {name: value.reshape(-1)[0].item() for name, value in values.items()
                      if isinstance(value, np.ndarray)}
            height, width, seed = scalar["HEIGHT"], scalar["WIDTH"], scalar["SEED"]
            if "FRAMES" in scalar:  # a video entry: VIDEO [1, F, H, W, 3]
                init = values.get("INIT_IMAGE")
                clip = expected_clip(request.model_name, values["PROMPT"], seed, height, width, scalar["FRAMES"],
                                     scalar["STEPS"], scalar["GUIDANCE_SCALE"], values.get("NEGATIVE_PROMPT"),
                                     None if init is None else init.reshape(height, width, 3))[None]
                with stub.lock:
                    stub.infers.append((request.model_name, values["PROMPT"], seed))
                output = service_pb2.ModelInferResponse.InferOutputTensor(name="VIDEO", datatype="UINT8",
                                                                         shape=list(clip.shape))
                return service_pb2.ModelInferResponse(model_name=request.model_name, outputs=[output],
                                                      raw_output_contents=[clip.tobytes()])
            init, mask = values.get("INIT_IMAGE"), values.get("MASK")
            edit = {} if init is None else {
                "init_image": init.reshape(height, width, 3), "mask": None if mask is None else mask.reshape(height, width),
                "strength": scalar.get("STRENGTH")}
            images = np.stack([expected_image(request.model_name, values["PROMPT"], seed + i, height, width,
                                              scalar["STEPS"], scalar["GUIDANCE_SCALE"], values.get("NEGATIVE_PROMPT"),
                                              values.get("LORAS"), **edit) for i in range(scalar.get("NUM_IMAGES", 1))])
            with stub.lock:
                stub.infers.append((request.model_name, values["PROMPT"], seed))
            output = service_pb2.ModelInferResponse.InferOutputTensor(name="IMAGE", datatype="UINT8",
                                                                     shape=list(images.shape))
            return service_pb2.ModelInferResponse(model_name=request.model_name, outputs=[output],
                                                  raw_output_contents=[images.tobytes()])

        def ModelStreamInfer(self, request_iterator, context):
            """The video entry's stream: a STEP message every PREVIEW_EVERY steps (before the last), then the
            entry's own answer to the request (ModelInfer: logged, gated and cancellable as a plain call)."""
            for request in request_iterator:
                if not stub.video_stream or not request.model_name.endswith(STREAM):
                    context.abort(grpc.StatusCode.NOT_FOUND, f"stub triton: no stream model {request.model_name}")
                values = {t.name: _decode(t, raw) for t, raw in zip(request.inputs, request.raw_input_contents,
                                                                     strict=True)}
                if "NUM_IMAGES" in values:  # as Triton answers it: the stream model declares no such input
                    yield service_pb2.ModelStreamInferResponse(error_message=(
                        f"unexpected inference input 'NUM_IMAGES' for model '{request.model_name}'"))
                    continue
                steps = int(values["STEPS"].reshape(-1)[0])
                every = int(values["PREVIEW_EVERY"].reshape(-1)[0]) if "PREVIEW_EVERY" in values else 5
                for done in range(every, steps, every):
                    while stub.step_gate is not None and not stub.step_gate.acquire(timeout=0.05):
                        if not context.is_active():
                            stub.cancelled.set()
                            return
                    with stub.lock:
                        stub.steps_sent.append(done)
                    step = service_pb2.ModelInferResponse.InferOutputTensor(name="STEP", datatype="INT32",
                                                                            shape=[1, 1])
                    yield service_pb2.ModelStreamInferResponse(infer_response=service_pb2.ModelInferResponse(
                        model_name=request.model_name, outputs=[step],
                        raw_output_contents=[np.array([[done]], np.int32).tobytes()]))
                entry = service_pb2.ModelInferRequest()
                entry.CopyFrom(request)
                entry.model_name = request.model_name.removesuffix(STREAM)
                yield service_pb2.ModelStreamInferResponse(infer_response=self.ModelInfer(entry, context))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    stub.server = server
    stub.url = f"127.0.0.1:{port}"
    return stub
