"""The pipeline python models: `full` (the public entry: the whole generation, cancellable every step, requests
batched together: see batching.py), `stream` (decoupled: previews every K steps, then the image) and the
ensemble's stages `encode`, `denoise`, `decode`. All run `EnginePipeline` over BLS runners
built from pipeline.json, so they compute exactly what the in-process pipeline computes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...engines_file.engine_spec import Size
from ...errors import RuntimeInputError
from .. import contract
from ..description import SKELETON_DIR, PipelineDescription
from . import pb
from .bls import EngineCallError, RequestCancelled, RequestContext, bls_runner_table
from .requests import read_request
from .warmup import warm_up_in_process

# The long-running stages (several instances each): a person's request there is published for the pipeline's other
# instances, and a job's request there waits between engine calls while one runs (activity.py, issue 46)
YIELDING_STAGES = ("full", "stream", "denoise")


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from ...runtime.pipeline import EnginePipeline

        config = json.loads(args["model_config"])
        self.name = config["name"]
        self.stage = config["parameters"]["stage"]["string_value"]
        folder = Path(args["model_repository"]) / args["model_version"]
        self.description = PipelineDescription.read(folder)
        self.context = RequestContext()
        self.context.served_loras = self.description.loras  # what LORAS may name (issue 28)
        # the workflows engines.yaml declares (recorded at package): a request for another is refused by name;
        # its CFG modes: `parallel` issues a step's two denoiser calls at once (bls.py: to two engine instances)
        self.pipeline = EnginePipeline(folder / SKELETON_DIR, self.description.family,
                                       bls_runner_table(self.description, self.context),
                                       workflows=self.description.workflows, cfg=self.description.cfg,
                                       text_lengths=self.description.text_lengths,  # Qwen-Image's text_length
                                       step_cache=self.description.step_cache_object)
        # Imports, tokenizers and scheduler code warmed before the server reports ready (no engine calls:
        # BLS is not available during initialize; the engine models warm themselves with model_warmup).
        seconds = warm_up_in_process(self.pipeline, self.description)
        pb.utils().Logger.log_info(f"{self.name}: python warm-up took {seconds:.2f} s")
        parameters = config["parameters"]
        self.max_images = int(parameters.get("max_images", {}).get("string_value", "1") or 1)
        self.metrics = None
        # the entry exports the serving metrics (metrics.py, docs/triton.md); the stream counts its jobs' pauses
        # (the API's video jobs run there)
        if self.stage in ("full", "stream"):
            from .metrics import Metrics

            self.metrics = Metrics()
        self.context.metrics, self.context.model = self.metrics, self.name
        if self.stage in YIELDING_STAGES:
            self.context.activity = _activity(self.description.pipeline)
        self._serve = {"full": self._full, "stream": self._stream, "encode": self._encode,
                       "denoise": self._denoise, "decode": self._decode}[self.stage]

    def finalize(self) -> None:
        if self.context.activity is not None:
            self.context.activity.close()

    def execute(self, requests: list) -> list | None:
        if self.stage == "full":  # the dynamic batcher's batch, served together
            from .batching import serve_batch

            return serve_batch(self.name, self.pipeline, self.context, requests, self.max_images, self.metrics)
        if self.stage == "stream":
            for request in requests:
                self._stream(request)
            return None  # decoupled: every response went through the request's response sender
        responses = []
        for request in requests:
            self.context.request = request
            start = time.perf_counter()
            try:
                self.context.publish_people([request])  # the denoise stage's (activity.py); the others have none
                responses.append(self._serve(request))
            except RuntimeInputError as err:
                responses.append(pb.error_response(f"{self.name}: {err}"))
            except RequestCancelled:
                message = f"{self.name}: request cancelled after {time.perf_counter() - start:.2f} s"
                pb.utils().Logger.log_info(message)  # the client is gone: the log is where this shows
                responses.append(pb.error_response(message, "CANCELLED"))
            except EngineCallError as err:
                responses.append(pb.error_response(f"{self.name}: {err}", "INTERNAL"))
            except Exception as err:  # noqa: BLE001 - a bug answers this request, the model stays up
                responses.append(pb.internal_error(self.name, err))
            finally:
                self.context.publish_people([])
                self.context.request, self.context.loras = None, ()
        return responses

    # ------------------------------------------------------------------ stages

    def _read(self, request: Any, *, with_prompt: bool = True):
        """The request, its LoRA set made the one the engine calls carry."""
        generation_request = read_request(request, with_prompt=with_prompt, served_loras=self.description.loras)
        self.context.loras = generation_request.loras
        return generation_request

    def _full(self, request: Any):
        generation = self.pipeline.generate(self._read(request))
        return _response({"IMAGE": generation.images[0]})

    def _stream(self, request: Any) -> None:
        """Previews every PREVIEW_EVERY steps (PREVIEW [1, h, w, 3], a video's [1, f, h, w, 3]: each latent frame,
        STEP), then IMAGE (VIDEO), then the final flag.
        A cancelled stream stops at the next engine call, freeing the instance within one step."""
        from .batching import response_with_timing, result_name, sent_ns, timing_json
        from .previews import preview

        utils = pb.utils()
        sender = request.get_response_sender()
        final = utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        start, start_ns = time.perf_counter(), time.time_ns()
        self.context.request, self.context.cancelled = request, sender
        try:
            self.context.publish_people([request])  # a person's stream: a job on another instance waits for it
            self.context.lora_switch_s = 0.0
            generation_request = self._read(request)
            every = pb.input_array(request, "PREVIEW_EVERY")
            every = contract.DEFAULT_PREVIEW_EVERY if every is None else int(every.reshape(-1)[0])
            if every < 1:
                raise RuntimeInputError(f"PREVIEW_EVERY must be at least 1 (a preview every that many steps), "
                                        f"got {every}")

            def on_step(index: int, total: int, latents: list) -> None:
                done = index + 1
                if done % every == 0 and done < total:
                    image = preview(latents[0][0].numpy(), self.description.family, generation_request.height,
                                    generation_request.width)
                    sender.send(utils.InferenceResponse([
                        utils.Tensor("PREVIEW", image[None]), utils.Tensor("STEP", np.array([[done]], np.int32))]))

            generation = self.pipeline.generate(generation_request, on_step)
            timing = timing_json([generation.timings], start, sent_ns(request), start_ns, self.context.lora_switch_s)
            tensor = utils.Tensor(result_name(generation.images), generation.images)
            sender.send(response_with_timing([tensor], timing, 1), flags=final)
        except RuntimeInputError as err:
            sender.send(pb.error_response(f"{self.name}: {err}"), flags=final)
        except RequestCancelled:
            pb.utils().Logger.log_info(f"{self.name}: stream cancelled after {time.perf_counter() - start:.2f} s")
            sender.send(pb.error_response(f"{self.name}: request cancelled", "CANCELLED"), flags=final)
        except EngineCallError as err:
            sender.send(pb.error_response(f"{self.name}: {err}", "INTERNAL"), flags=final)
        except Exception as err:  # noqa: BLE001 - a bug answers this request, the model stays up
            sender.send(pb.internal_error(self.name, err), flags=final)
        finally:
            self.context.publish_people([])
            self.context.request, self.context.cancelled, self.context.loras = None, None, ()

    def _encode(self, request: Any):
        generation_request = self._read(request)
        self.pipeline.validate(generation_request)  # refuse a bad request before any engine runs
        encoding = self.pipeline.encode(generation_request)
        positive, negative = encoding.positive, encoding.negative
        outputs = {"POSITIVE_EMBEDS": positive.embeds,
                   "NEGATIVE_EMBEDS": np.zeros_like(positive.embeds) if negative is None else negative.embeds,
                   "USE_NEGATIVE": np.array([negative is not None])}
        if positive.pooled is not None:
            outputs["POSITIVE_POOLED"] = positive.pooled
            outputs["NEGATIVE_POOLED"] = np.zeros_like(positive.pooled) if negative is None else negative.pooled
        return _response(outputs)

    def _denoise(self, request: Any):
        from ...runtime.pipeline import Conditioning, PromptEncoding

        generation_request = self._read(request, with_prompt=False)
        self.pipeline.validate(generation_request)

        def tensor(name: str) -> np.ndarray | None:
            value = pb.input_array(request, name)
            return None if value is None else np.ascontiguousarray(value[0])

        positive = Conditioning(tensor("POSITIVE_EMBEDS"), tensor("POSITIVE_POOLED"))
        negative = Conditioning(tensor("NEGATIVE_EMBEDS"), tensor("NEGATIVE_POOLED"))
        use_negative = bool(tensor("USE_NEGATIVE").reshape(-1)[0])
        encoding = PromptEncoding(positive, negative if use_negative else None)
        latents, _ = self.pipeline.denoise(generation_request, encoding)
        return _response({"LATENTS": latents.numpy()})

    def _decode(self, request: Any):
        import torch

        latents = np.ascontiguousarray(pb.input_array(request, "LATENTS")[0])
        height = int(pb.input_array(request, "HEIGHT").reshape(-1)[0])
        width = int(pb.input_array(request, "WIDTH").reshape(-1)[0])
        images = self.pipeline.decode(torch.from_numpy(latents), Size(width, height), latents.shape[0])
        return _response({"IMAGE": images[0]})


def _activity(pipeline: str):
    """This instance's place among the pipeline's instances on this server (activity.py), or None where the folder
    cannot be had (logged: jobs then never yield, nothing else changes)."""
    from .activity import Activity

    try:
        return Activity.for_server(pipeline)
    except OSError as err:
        pb.utils().Logger.log_warn(f"{pipeline}: batch requests will not yield to people: {err}")
        return None


def _response(outputs: dict[str, np.ndarray]):
    """Adds the request batch dimension (these models have max_batch_size 1)."""
    utils = pb.utils()
    return utils.InferenceResponse([utils.Tensor(name, np.ascontiguousarray(value)[None])
                                    for name, value in outputs.items()])
