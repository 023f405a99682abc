"""Opening the deployment preflight checks: package + start a server on loopback, connect to --url (and make sure
it serves this engines.yaml's model and engines), or the pipeline in process."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..engines_file import EnginesConfig, EngineSpec, expand
from ..errors import BuildError, ServeError
from ..families import Component, family_info
from ..sample_inputs import natural_workflow, request_fields
from ..triton import naming
from ..triton.client import ImageRequest
from ..workflows import Workflow
from .deployment import DENOISERS, InProcessDeployment, ServedBucket, ServedDeployment


@dataclass
class Engines:
    """The engines the plan wants for one model and target (base variant): found in the workspace, or missing."""

    model: str
    target: str
    found: list  # BuiltEngine
    missing: list[EngineSpec]

    @property
    def keys(self) -> list[str]:
        return sorted(e.spec.key for e in self.found)

    def by_key(self) -> dict:
        return {e.spec.key: e for e in self.found}


def find_engines(config: EnginesConfig, model: str, target: str) -> Engines:
    from ..targets import get_target

    wanted = [s for s in expand(config) if s.model == model and s.target == target
              and (not Component(s.component).is_denoiser or s.lora_variant is None)]
    if not wanted:
        raise BuildError(f"{model} has no {target} engines in {config.path}")
    found, missing = [], []
    for spec in wanted:
        engine = get_target(spec.target).find(Path(config.workspace), spec)
        (missing if engine is None else found).append(spec if engine is None else engine)
    denoiser = family_info(config.models[model].family).denoiser.value
    unbucketed = [s.name for s in missing if s.bucket is None]
    if unbucketed:  # a text encoder every request needs: nothing can be served
        raise BuildError(f"{len(unbucketed)} {target} engine(s) of {model} are not built or not current "
                         f"({', '.join(unbucketed[:3])}); run `trt-diffusion build {config.path} --target {target}`")
    if not any(e.spec.component == denoiser for e in found):
        raise BuildError(f"no {target} {denoiser} engine of {model} is built in {config.workspace}; run "
                         f"`trt-diffusion build {config.path} --target {target}` first")
    return Engines(model, target, found, missing)


def servable(engines: Engines) -> list:
    """Engines that make whole buckets: a bucket whose denoiser or VAE decoder is missing is left out (the
    buckets check reports it)."""
    missing_buckets = {b for s in engines.missing for b in s.buckets if b is not None}
    return [e for e in engines.found if any(b is None or b not in missing_buckets for b in e.spec.buckets)]


def served_buckets(engines: list) -> list[ServedBucket]:
    seen = {}
    for engine in engines:
        spec = engine.spec
        for bucket in spec.buckets if spec.component in DENOISERS and not spec.controlnet else ():
            if bucket is not None:
                seen.setdefault(bucket.label, ServedBucket(bucket.label, bucket.opt, bucket.max))
    return list(seen.values())


def _controlnets(engines: list) -> list[str]:
    return sorted({e.spec.controlnet for e in engines if e.spec.controlnet})


def in_process(config: EnginesConfig, engines: Engines, *, table=None, honour_deadline: bool = True
               ) -> InProcessDeployment:
    """The pipeline over the built engines in this process (`table`: runners to use instead, for tests)."""
    from ..runtime.loader import table_from_engines

    model = config.models[engines.model]
    usable = servable(engines)
    buckets = [b for b in model.buckets if any(b in e.spec.buckets for e in usable)]
    return InProcessDeployment(naming.entry_name(naming.sanitize(engines.model)), model.family.value,
                               model.source.path, table if table is not None else table_from_engines(usable),
                               [e.spec.key for e in usable], buckets, honour_deadline=honour_deadline,
                               workflows=model.workflows, text_lengths=model.text_lengths,
                               step_cache=model.step_cache)


def start_served(config: EnginesConfig, engines: Engines, *, protocol: str, work_dir: Path,
                 ready_timeout_s: float, first_request_steps: int) -> ServedDeployment:
    """Package the built engines into `work_dir/triton_repo`, start tritonserver on loopback (free ports), and
    time each bucket's first request before anything else reaches the server."""
    from ..triton.repository import PackageOptions, package
    from ..triton.stage import start

    model = config.models[engines.model]
    usable = servable(engines)
    # package's defaults (instances, queue) without the ensemble: preflight checks the entry clients use, and
    # four fewer python processes start faster.
    report = package(usable, model.source.path, model.family, engines.model, work_dir / "triton_repo",
                     PackageOptions(ensemble=False), workflows=model.workflows, cfg=model.cfg)  # as `package` does
    server, _ = start(work_dir / "triton_repo", work_dir=work_dir / "server", ready_timeout_s=ready_timeout_s,
                      first_request=False, protocol=protocol)
    url = server.grpc_url if protocol == "grpc" else server.http_url
    try:
        deployment = ServedDeployment(
            url, protocol, pipeline=report.pipeline, family=report.family, buckets=served_buckets(usable),
            controlnets=_controlnets(usable), engine_keys=[e.spec.key for e in usable],
            denoiser_models=[m.name for m in report.engine_models() if m.component in DENOISERS],
            instances=report.options["pipeline_instances"], max_queue_size=report.options["max_queue_size"],
            entry=report.entry, server=server, metrics_url=f"127.0.0.1:{server.ports.metrics}")
        deployment.first_requests = time_first_requests(deployment, first_request_steps,
                                                        workflow=natural_workflow(model.workflows))
    except BaseException:
        server.stop()
        raise
    return deployment


def time_first_requests(deployment, steps: int, timeout_s: float = 600.0,
                        workflow: Workflow = Workflow.txt2img) -> dict[str, float]:
    """Seconds of each bucket's first request, in `workflow` (the model's natural one: an image-to-video model's
    first request carries its seeded first frame)."""
    deployment.health()  # opens the connection: its setup is the client's cost, not the first request's
    seconds = {}
    for bucket in deployment.buckets:
        size = bucket.request
        request = ImageRequest("first request", size.height, size.width, steps=steps, seed=0,
                               frames=size.frames or None, **request_fields(workflow, size.height, size.width))
        start = time.perf_counter()
        deployment.generate(request, timeout_s)
        seconds[bucket.label] = time.perf_counter() - start
    return seconds


# ---------------------------------------------------------------------------- --url


def connect_served(url: str, protocol: str, config: EnginesConfig, engines: Engines,
                   metrics_url: str | None = None) -> ServedDeployment:
    """The server at `url`, checked to serve this model's built engines: one clear error otherwise."""
    from ..triton.client import client_module, connect, deadline, parse_url

    client_module(protocol)
    address, _ = parse_url(url, protocol)
    pipeline = naming.entry_name(naming.sanitize(engines.model))
    client = connect(url, protocol, 30.0)
    try:
        with deadline(CONNECT_DEADLINE_S, url, "reading what the server serves"):
            return _connect_served(client, url, address, protocol, pipeline, config, engines, metrics_url)
    finally:
        client.close()


CONNECT_DEADLINE_S = 120.0  # the whole conversation that checks a --url server (each reply is read within it)


def _connect_served(client, url: str, address: str, protocol: str, pipeline: str, config: EnginesConfig,
                    engines: Engines, metrics_url: str | None) -> ServedDeployment:
    try:
        live = client.is_server_live()
    except Exception as err:  # noqa: BLE001 - tritonclient raises its own exception or a socket error
        raise ServeError(f"cannot reach Triton at {url} over {protocol} ({_message(err)}); is "
                         "`trt-diffusion serve` running there?") from None
    if not live:
        raise ServeError(f"Triton at {url} is not live")
    models = _models(client, protocol, url)
    entries = {name: params for name, (params, _) in models.items() if params.get("trt_diffusion_role") == "entry"}
    if pipeline not in entries:
        served = ", ".join(sorted(entries)) or "no trt-diffusion pipeline"
        raise ServeError(f"Triton at {url} serves {served}, not {engines.model} of {config.path}; serve this "
                         f"model's repository (trt-diffusion package {config.path} && trt-diffusion serve)")
    by_key = engines.by_key()
    served_keys = {params.get("engine_key"): name for name, (params, _) in models.items()
                   if name.startswith(f"{pipeline}__") and params.get("trt_diffusion_role") == "engine"}
    foreign = sorted(name for key, name in served_keys.items() if key not in by_key)
    if foreign or not served_keys:
        listed = ", ".join(foreign[:4]) or "none"
        raise ServeError(f"Triton at {url} serves {pipeline} with other engines than the {engines.target} "
                         f"engines built in {config.workspace} ({len(foreign)} not built here: {listed}); "
                         "package and serve the engines of this workspace")
    served = [e for e in engines.found if e.spec.key in served_keys]  # engines.yaml's order, not the index's
    entry_config = models[pipeline][1]
    instances, queue = _instances_and_queue(entry_config, url)
    return ServedDeployment(
        address, protocol, pipeline=pipeline, family=config.models[engines.model].family.value,
        buckets=served_buckets(served), controlnets=_controlnets(served), engine_keys=[e.spec.key for e in served],
        denoiser_models=[name for key, name in served_keys.items() if by_key[key].spec.component in DENOISERS],
        instances=instances, max_queue_size=queue, entry=pipeline, metrics_url=metrics_url or _metrics_guess(address))


def _message(err: Exception) -> str:
    return err.message() if hasattr(err, "message") and callable(err.message) else str(err)


def _models(client, protocol: str, url: str = "") -> dict[str, tuple[dict[str, str], dict]]:
    """name -> (string parameters, config as JSON) of every loaded model; ServeError for a malformed reply."""
    from ..triton.client import malformed

    kwargs = {"as_json": True} if protocol == "grpc" else {}
    try:
        index = client.get_model_repository_index(**kwargs)
    except Exception as err:  # noqa: BLE001 - tritonclient's own error, a socket error, or unparsable JSON
        if isinstance(err, ServeError):
            raise
        raise ServeError(f"Triton at {url}: cannot read its repository index ({_message(err)[:200]})") from None
    try:
        rows = index.get("models", []) if isinstance(index, dict) else index
        rows = list(rows)
    except (TypeError, AttributeError) as exc:
        raise malformed(url, "the repository index", exc) from None
    found = {}
    for row in rows:
        if not isinstance(row, dict):
            raise malformed(url, "the repository index", TypeError(f"a row is {type(row).__name__}, not an object"))
        name = row.get("name")
        if not isinstance(name, str) or not name or row.get("state", "READY") != "READY":
            continue
        try:
            config = client.get_model_config(name, **kwargs)
        except ServeError:
            raise
        except Exception:  # noqa: BLE001 - a model that failed to load has no config
            continue
        try:
            config = config.get("config", config)
            params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        except (TypeError, AttributeError) as exc:
            raise malformed(url, f"the config of {name}", exc) from None
        if not all(isinstance(v, str) for v in params.values()):
            raise malformed(url, f"the config of {name}", TypeError("a string parameter is not a string"))
        found[name] = (params, config)
    return found


def _instances_and_queue(config: dict, url: str = "") -> tuple[int | None, int | None]:
    from ..triton.client import malformed

    try:
        groups = config.get("instance_group") or []
        instances = sum(int(g.get("count", 1)) for g in groups) or None
        policy = (config.get("dynamic_batching") or {}).get("default_queue_policy") or {}
        queue = int(policy.get("max_queue_size", 0) or 0)
    except (TypeError, ValueError, AttributeError) as exc:
        raise malformed(url, "the entry model's config", exc) from None
    return instances, queue or None


def _metrics_guess(address: str) -> str:
    """`trt-diffusion serve` puts metrics on 8002 beside HTTP 8000 / gRPC 8001."""
    host = address.rpartition(":")[0] or address
    return f"{host}:8002"
