"""One request cannot fail another (issue 44, finding 3), in process, through the python models' own `execute()`:

- the public entry (batching.py) parses every request before batching: a LORAS scale of 400 digits (float()
  raised OverflowError), a LORAS nested 2000 deep (RecursionError) or a SEED whose NUM_IMAGES seeds pass INT64
  is that request's INVALID_ARG, and the batch runs the good requests; a fault that is not the user's is an
  INTERNAL reply naming no path and carrying no traceback (those go to the server's log);
- an engine model called directly with `trt_diffusion_loras` refuses a NaN, infinite or out-of-range scale
  before any refit.

The entry's pipeline is the real EnginePipeline over the sd15 tiny plan's routing table (validation and batch
planning are its own); only its engine calls are replaced, by a recorder that answers zero images.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from trt_diffusion.runtime.pipeline import Generation, StageTimings
from trt_diffusion.triton import contract
from trt_diffusion.triton.backend import engine_model, pb, pipeline_model
from trt_diffusion.triton.backend.bls import RequestContext
from trt_diffusion.triton.client import ImageRequest

SIZE = 64
SERVED_LORAS = ("style",)


class FakeUtils:
    """What the python backend's utils give a model: responses, tensors, errors, its log."""

    logged: list[str] = []

    class TritonError:
        INVALID_ARG, INTERNAL, CANCELLED = "INVALID_ARG", "INTERNAL", "CANCELLED"

        def __init__(self, message, code):
            self.message, self.code = message, code

    class Logger:
        @staticmethod
        def log_error(text):
            FakeUtils.logged.append(text)

        log_info = log_error

    class InferenceResponse:
        def __init__(self, tensors=(), error=None, parameters=None):
            self.tensors, self.error = list(tensors), error

    @staticmethod
    def Tensor(name, value):  # noqa: N802 - the backend's name
        return (name, value)


class Request(dict):
    """A Triton request: its tensors by name, its parameters (JSON) as the backend reads them."""

    def __init__(self, tensors, parameters=None):
        super().__init__(tensors)
        self._parameters = json.dumps(parameters or {}, allow_nan=True)

    def parameters(self):
        return self._parameters


@pytest.fixture(autouse=True)
def backend(monkeypatch):
    FakeUtils.logged = []
    monkeypatch.setattr(pb, "utils", lambda: FakeUtils)
    monkeypatch.setattr(pb, "input_array", lambda request, name: request.get(name))


@pytest.fixture(scope="module")
def entry_pipeline(tmp_path_factory, tiny_model_factory, write_engines_yaml):
    """The sd15 tiny plan (64x64) as the entry's EnginePipeline, every engine call answered by a recorder."""
    from trt_diffusion.engines_file import expand, load_engines_file
    from trt_diffusion.runtime.engines import RunnerTable
    from trt_diffusion.runtime.pipeline import EnginePipeline

    model_dir = tiny_model_factory("sd15")
    config = write_engines_yaml(tmp_path_factory.mktemp("isolation"), model_dir, "sd15", name="sd15-tiny")
    table = RunnerTable()
    for spec in expand(load_engines_file(config)):
        table.add(spec.component, None, bucket=spec.bucket, batch=spec.batch, controlnet=spec.controlnet)
    return EnginePipeline(model_dir, "sd15", table)


@pytest.fixture
def entry(entry_pipeline, monkeypatch):
    """The public entry model (stage `full`) without a server: its execute() runs serve_batch."""
    ran: list[list] = []

    def generate_together(requests, on_step=None):
        ran.append(list(requests))
        return [Generation(np.zeros((1, r.height, r.width, 3), np.uint8), StageTimings(batch=len(requests)), "none")
                for r in requests]

    monkeypatch.setattr(entry_pipeline, "generate_together", generate_together)
    model = pipeline_model.TritonPythonModel()
    model.name, model.stage, model.pipeline, model.max_images, model.metrics = \
        "sd15-tiny", "full", entry_pipeline, 4, None
    model.context = RequestContext()
    model.context.served_loras = SERVED_LORAS
    return SimpleNamespace(model=model, ran=ran)


def image_request(seed: int = 0, **change) -> Request:
    request = ImageRequest(prompt=f"a lighthouse {seed}", height=SIZE, width=SIZE, steps=2, guidance_scale=7.5,
                           seed=seed, **change)
    return Request(request.tensors())


def _reply_text(response) -> str:
    return "" if response.error is None else response.error.message


BAD_ENTRY_REQUESTS = {
    "400-digit scale": (dict(loras='[{"name": "style", "scale": ' + "9" * 400 + "}]"),
                        "LORAS[0].scale must be a finite number in [-100, 100]"),
    "negative 400-digit scale": (dict(loras='[{"name": "style", "scale": -' + "9" * 400 + "}]"),
                                 "LORAS[0].scale must be a finite number in [-100, 100]"),
    "1e400 scale": (dict(loras='[{"name": "style", "scale": 1e400}]'), "LORAS[0].scale must be a finite number"),
    "nested 2000 deep": (dict(loras="[" * 2000 + "]" * 2000), "LORAS is nested too deeply"),
    "seeds past INT64": (dict(seed=2**63 - 1, num_images=2),
                         "SEED 9223372036854775807 with NUM_IMAGES 2 gives seeds up to 9223372036854775808"),
}


@pytest.mark.parametrize("change, message", BAD_ENTRY_REQUESTS.values(), ids=BAD_ENTRY_REQUESTS)
def test_one_bad_request_fails_alone_and_the_batch_runs_the_others(entry, change, message):
    seed = change.pop("seed", 3)
    requests = [image_request(1), image_request(2), image_request(seed, **change), image_request(4)]
    responses = entry.model.execute(requests)
    assert len(responses) == 4
    bad = responses[2]
    assert bad.error is not None and bad.error.code == "INVALID_ARG", _reply_text(bad)
    assert message in bad.error.message and bad.error.message.startswith("sd15-tiny: ")
    for good in (responses[0], responses[1], responses[3]):
        assert good.error is None, _reply_text(good)
        assert [name for name, _ in good.tensors] == ["IMAGE", "TIMING"]
    # the three good requests ran, together (one batch key), and the bad one never reached the engines
    assert sorted(r.seed for batch in entry.ran for r in batch) == [1, 2, 4]


def test_the_last_seed_of_int64_still_serves_one_image(entry):
    (response,) = entry.model.execute([image_request(2**63 - 1)])
    assert response.error is None, _reply_text(response)
    assert [r.seed for batch in entry.ran for r in batch] == [2**63 - 1]


def test_a_fault_that_is_not_the_users_is_internal_without_path_or_traceback(entry, monkeypatch):
    """A request whose checks hit a bug (here: validation raising a ValueError with a path in it) gets INTERNAL
    naming only the error's kind; its partners still run; the server's log has the whole traceback."""
    real_validate = entry.model.pipeline.validate

    def validate(request):
        if request.seed == 3:
            raise ValueError("could not read /srv/secret/models/sd15/unet/config.json")
        return real_validate(request)

    monkeypatch.setattr(entry.model.pipeline, "validate", validate)
    responses = entry.model.execute([image_request(1), image_request(3), image_request(4)])
    bad = responses[1]
    assert bad.error is not None and bad.error.code == "INTERNAL"
    assert bad.error.message == "sd15-tiny: internal error (ValueError); the server log has the details"
    assert "/srv/secret" not in bad.error.message and "Traceback" not in bad.error.message
    assert responses[0].error is None and responses[2].error is None
    assert sorted(r.seed for batch in entry.ran for r in batch) == [1, 4]
    assert any("Traceback" in text and "/srv/secret" in text for text in FakeUtils.logged)


# --- an engine model called directly with trt_diffusion_loras ---------------------------------------------------


@pytest.fixture
def lora_engine(tmp_path, monkeypatch):
    """An engine model serving LoRA `style` (its loras/ folder as package writes it) over a recording runner;
    `refits` lists the weights of every LoRA runner made (each a refit)."""
    from safetensors.numpy import save_file

    from trt_diffusion import targets
    from trt_diffusion.runtime.runners import CallableRunner
    from trt_diffusion.targets.lora_switch import BASE_FILE, FOLDER, INDEX_FILE, SCHEMA_VERSION
    from trt_diffusion.tensors import TensorSpec
    from trt_diffusion.workspace.files import sha256_file

    version = tmp_path / "sd15__unet__64x64__b2" / "1"
    loras = version / FOLDER
    loras.mkdir(parents=True)
    save_file({"w": np.ones(4, np.float32)}, str(loras / BASE_FILE))
    save_file({"w": np.full(4, 0.5, np.float32)}, str(loras / "lora-style.safetensors"))
    (loras / INDEX_FILE).write_text(json.dumps({
        "schema_version": SCHEMA_VERSION, "component": "unet",
        "base": {"file": BASE_FILE, "sha256": sha256_file(loras / BASE_FILE)},
        "loras": {"style": {"file": "lora-style.safetensors", "sha256": sha256_file(loras / "lora-style.safetensors")}}}))
    spec = {"latent": TensorSpec(np.dtype(np.float32), (2, 4, 8, 8))}

    def runner(value: float):
        return CallableRunner(lambda feeds: {"noise": np.full((2, 4, 8, 8), value, np.float32)}, spec, name="unet")

    refits = []

    def lora_runner(folder, name, weights, base):
        refits.append(weights)
        return runner(float(weights["w"][0]))

    monkeypatch.setattr(targets, "get_target", lambda name: SimpleNamespace(
        runner_from_files=lambda folder, n: runner(0.0), lora_runner=lora_runner))
    model = engine_model.TritonPythonModel()
    model.initialize({"model_config": json.dumps({
        "name": version.parent.name, "parameters": {"target": {"string_value": "onnxruntime"}},
        "output": [{"name": "noise"}]}), "model_repository": str(version.parent), "model_version": "1"})
    return SimpleNamespace(model=model, refits=refits)


def engine_request(scale) -> Request:
    return Request({"latent": np.zeros((2, 4, 8, 8), np.float32)},
                   {contract.LORAS_PARAMETER: json.dumps([{"name": "style", "scale": scale}], allow_nan=True)})


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 1e30, -101.0, 10**400],
                         ids=["nan", "inf", "-inf", "1e30", "-101", "400 digits"])
def test_an_engine_model_refuses_a_scale_that_is_not_finite_or_in_range(lora_engine, scale):
    good, bad, after = lora_engine.model.execute([engine_request(0.5), engine_request(scale), engine_request(0.5)])
    assert bad.error is not None and bad.error.code == "INVALID_ARG", _reply_text(bad)
    assert "scale must be a finite number in [-100, 100]" in bad.error.message
    assert good.error is None and after.error is None
    assert float(dict(good.tensors)["noise"].reshape(-1)[0]) == 1.25  # base 1 + 0.5 * delta 0.5
    assert len(lora_engine.refits) == 1  # the good set once; the refused scale made no refit and evicted nothing


def test_every_models_internal_reply_names_the_kind_only(monkeypatch):
    """The pipeline's stage models (stream, encode, denoise, decode) answer a bug through pb.internal_error too:
    before, its reply carried the error's text (`internal error ValueError: <message with a path>`)."""
    monkeypatch.setattr(pb, "utils", lambda: FakeUtils)
    reply = pb.internal_error("sd15-tiny_decode", ValueError("cannot open /srv/secret/vae/config.json"))
    assert reply.error.code == "INTERNAL"
    assert reply.error.message == "sd15-tiny_decode: internal error (ValueError); the server log has the details"
    assert any("/srv/secret" in text for text in FakeUtils.logged)
