"""Kubernetes manifests for a packaged repository (`package --kubernetes DIR`; docs/deploy.md, "A cluster").

Plain YAML documents built as dicts from what the package knows — its report (entries, options, the served-memory
estimate) and the written configs (which engine models run on a GPU) — one object per file:

- `triton-deployment.yaml`: tritonserver pods (`replicas`) serving the repository from a volume mounted read-only,
  readiness on Triton's `/v2/health/ready`, liveness (and a startup probe, loading takes a while) on
  `/v2/health/live`, the HTTP, gRPC and metrics ports named; a memory request of the recorded estimate and
  `nvidia.com/gpu` only where engine models run on a GPU (KIND_GPU: TensorRT's);
- `triton-service.yaml`, `triton-pdb.yaml` (at most one tritonserver pod down at a time for a voluntary disruption);
- `repository-pvc.yaml`: the claim the repository is copied into (its size from the repository's bytes);
- `openai-deployment.yaml` + `openai-service.yaml` + `openai-state-pvc.yaml`: `trt-diffusion openai-api` in front of
  the Triton Service, its job store on the claim. One replica, replaced by Recreate: the store is SQLite, a single
  writer (one API process per state folder);
- `openai-config.yaml` only when a model of engines.yaml declares `serving: overload:`: a ConfigMap holding that
  engines.yaml, mounted into the API pod and named by its `--config`, so the cluster's API applies the same policies;
- `triton-hpa.yaml` only with `max_replicas`: an HPA on Triton's pending-request gauge, which needs a custom-metrics
  adapter in the cluster.

Written like the repository: into a staging folder beside DIR, then renamed into place; a folder that holds other
files than manifests written here is refused, never replaced."""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .. import __version__
from ..errors import ServeError
from .repository import swap_into_place
from .server import ADMIN_HEADER, RESTRICTED_APIS, tensorrt_args
from .stage import SERVER_ARGS

DEFAULT_IMAGE = f"trt-diffusion:{__version__}"  # built by the user: tritonserver + trt-diffusion (docs/deploy.md)
DEFAULT_STATE_GB = 10.0  # openai-api's --state-max-gb default (cli/openai_commands.py)
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
API_PORT = 8080
REPOSITORY_MOUNT = "/models"
STATE_MOUNT = "/var/lib/trt-diffusion"
CONFIG_MOUNT = "/etc/trt-diffusion"  # the ConfigMap's engines.yaml (openai-api --config), with an overload policy
CONFIG_FILE = "engines.yaml"
CONFIG_MAX_BYTES = 1024**2  # what a ConfigMap holds
MARKER = "# Written by `trt-diffusion package --kubernetes`"
# the longest suffix a name gets ("<name>-openai-state"): the whole must stay a 63-character DNS label
_LONGEST_SUFFIX = "-openai-state"
MAX_NAME = 63 - len(_LONGEST_SUFFIX)
# a DNS-1123 label that starts with a letter: what a Service's name must be (RFC 1035)
_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*")
GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class KubernetesOptions:
    replicas: int = 1  # tritonserver pods
    name: str | None = None  # the objects' name prefix; default: from the repository's entry
    namespace: str = "default"
    image: str = DEFAULT_IMAGE  # one image for both: tritonserver and trt-diffusion (the python models import it)
    repository_claim: str | None = None  # default <name>-repository
    state_gb: float = DEFAULT_STATE_GB  # the API's --state-max-gb; its claim gets a GiB more
    max_replicas: int | None = None  # set: an HPA from `replicas` to this

    def check(self) -> KubernetesOptions:
        """Raise ServeError naming the option of the first bad value."""
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ServeError(f"--replicas must be at least 1, got {self.replicas}")
        if self.name is not None:
            check_label(self.name, "--kubernetes-name", MAX_NAME)
        if not _NAMESPACE.fullmatch(self.namespace) or len(self.namespace) > 63:
            raise ServeError(f"--namespace {self.namespace!r} is not a DNS-1123 label (lower-case letters, digits "
                             "and '-', starting and ending with a letter or digit, at most 63 characters)")
        if not _IMAGE.fullmatch(self.image):
            raise ServeError(f"--image {self.image!r} is not an image reference (REGISTRY/NAME:TAG)")
        if self.repository_claim is not None:
            check_label(self.repository_claim, "--repository-claim", 63)
        if not self.state_gb > 0:
            raise ServeError(f"--state-max-gb must be positive, got {self.state_gb}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ServeError(f"--max-replicas ({self.max_replicas}) must be at least --replicas ({self.replicas})")
        return self


def check_label(value: str, option: str, longest: int) -> None:
    if not _LABEL.fullmatch(value) or len(value) > longest:
        raise ServeError(f"{option} {value!r} is not a DNS-1123 label: lower-case letters, digits and '-', starting "
                         f"with a letter and ending with a letter or digit, at most {longest} characters")


def default_name(report: Any) -> str:
    """The repository's first entry as a label (`sd15_tiny` -> `sd15-tiny`), else `trt-diffusion`."""
    name = re.sub(r"[^a-z0-9-]+", "-", report.entry.lower()).strip("-")[:MAX_NAME].rstrip("-")
    return name if _LABEL.fullmatch(name) else "trt-diffusion"


def _labels(name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "trt-diffusion", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component, "app.kubernetes.io/version": __version__}


def _selector(name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": component}


def _meta(name: str, options: KubernetesOptions, component: str, **extra: Any) -> dict:
    return {"name": name, "namespace": options.namespace, "labels": _labels(options.name or "", component), **extra}


def _gpus(repo: Path, report: Any) -> int:
    """GPUs a tritonserver pod needs: none unless an engine model's instances are KIND_GPU; then one, or up to the
    highest `--gpu` index the repository was packaged with (indices count from 0 inside the pod)."""
    from tritonclient.grpc import model_config_pb2 as mc

    from .validate import read_configs

    engines = {m.name for m in report.models if m.role == "engine"}
    on_gpu = any(group.kind == mc.ModelInstanceGroup.KIND_GPU
                 for name, config in read_configs(repo).items() if name in engines
                 for group in config.instance_group)
    if not on_gpu:
        return 0
    listed = list(report.options.get("gpus") or ())
    return max(listed) + 1 if listed else 1


def _repository_bytes(repo: Path) -> int:
    return sum(path.stat().st_size for path in repo.rglob("*") if path.is_file() and not path.is_symlink())


def _quantity(nbytes: float) -> str:
    return f"{max(1, math.ceil(nbytes / MIB))}Mi"


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def triton_command(repo: Path, gpus: int) -> list[str]:
    """tritonserver on the mounted repository, listening on the pod's address, its admin APIs closed behind a key
    drawn at each start as `serve` does (docs/security.md): a shell draws it."""
    apis = ",".join(RESTRICTED_APIS)
    args = [f"--model-repository={REPOSITORY_MOUNT}", *SERVER_ARGS, f"--http-port={PORTS['http']}",
            f"--grpc-port={PORTS['grpc']}", f"--metrics-port={PORTS['metrics']}", "--allow-metrics=true",
            f"--allow-gpu-metrics={'true' if gpus else 'false'}", "--strict-readiness=true", "--exit-on-error=true",
            "--log-verbose=0", *[arg.replace(str(repo), REPOSITORY_MOUNT) for arg in tensorrt_args(repo)],
            f'"--http-restricted-api={apis}:{ADMIN_HEADER}=$key"',
            f'"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}=$key"']
    return ["/bin/sh", "-c", 'key=$(od -An -N16 -tx1 /dev/urandom | tr -d " \\n") && exec tritonserver '
            + " ".join(args)]


def _probe(path: str, period_s: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s, "timeoutSeconds": 5,
            "failureThreshold": failures}


def overload_models(engines_yaml: str | Path | None) -> list[str]:
    """The models of engines.yaml that declare `serving: overload:` (their own or the defaults'): what the API
    applies with `--config` (its sources need not exist here, as on the API's host)."""
    if engines_yaml is None:
        return []
    from ..engines_file import load_engines_file

    config = load_engines_file(engines_yaml, check_sources=False)
    return [name for name, model in config.models.items() if model.serving.overload is not None]


def manifests(repo: str | Path, report: Any, options: KubernetesOptions,
              engines_yaml: str | Path | None = None) -> dict[str, tuple[str, dict]]:
    """file name -> (the comment above it, the object) for the repository at `repo` written with `report`;
    `engines_yaml` (what was packaged): shipped to the API as a ConfigMap when a model declares an overload policy."""
    repo = Path(repo)
    name = options.name or default_name(report)
    options = KubernetesOptions(**{**options.__dict__, "name": name}).check()
    triton, api = f"{name}-triton", f"{name}-openai"
    claim = options.repository_claim or f"{name}-repository"
    gpus = _gpus(repo, report)
    memory_gb = sum(share["total_gb"] for share in report.memory)
    requests: dict[str, Any] = {"cpu": "1"}
    if memory_gb:
        requests["memory"] = _quantity(memory_gb * 1e9)
    resources: dict[str, Any] = {"requests": requests}
    if gpus:
        resources["limits"] = {"nvidia.com/gpu": gpus}
    entries = ", ".join(p.entry for p in report.all_pipelines())
    pipeline_instances = int(report.options.get("pipeline_instances", 1))

    triton_pod = {
        "metadata": {"labels": _labels(name, "triton"),
                     "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORTS["metrics"])}},
        "spec": {
            "containers": [{
                "name": "tritonserver", "image": options.image, "command": triton_command(repo, gpus),
                "ports": [{"name": port, "containerPort": number, "protocol": "TCP"} for port, number in PORTS.items()],
                "readinessProbe": _probe("/v2/health/ready", 5, 3),
                "livenessProbe": _probe("/v2/health/live", 10, 3),
                "startupProbe": _probe("/v2/health/live", 10, 60),  # loading + warm-up: up to 10 minutes
                "resources": resources,
                "securityContext": {"allowPrivilegeEscalation": False},
                "volumeMounts": [{"name": "repository", "mountPath": REPOSITORY_MOUNT, "readOnly": True},
                                 {"name": "dshm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [{"name": "repository", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},
                        # the python backend exchanges tensors through /dev/shm: a container's default is 64 MB
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}],
        },
    }
    out: dict[str, tuple[str, dict]] = {}
    out["triton-deployment.yaml"] = (
        f"tritonserver serving {entries} from the repository on the claim {claim} (read-only). Resources: the "
        f"repository's served-memory estimate ({memory_gb:.2f} GB)"
        + (f"; {gpus} GPU(s): its engine models run on a GPU" if gpus else "; no GPU: no engine model runs on one"),
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(triton, options, "triton"),
         "spec": {"replicas": options.replicas, "selector": {"matchLabels": _selector(name, "triton")},
                  "template": triton_pod}})
    out["triton-service.yaml"] = (
        "Triton's HTTP, gRPC and metrics ports. The Service spreads connections, not requests: a gRPC client keeps "
        "one connection, so it uses one pod at a time (docs/deploy.md)",
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(triton, options, "triton"),
         "spec": {"selector": _selector(name, "triton"),
                  "ports": [{"name": port, "port": number, "targetPort": port, "protocol": "TCP"}
                            for port, number in PORTS.items()]}})
    out["triton-pdb.yaml"] = (
        "A voluntary disruption (a node drain) takes at most one tritonserver pod at a time",
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(triton, options, "triton"),
         "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(name, "triton")}}})
    repository_bytes = _repository_bytes(repo)
    out["repository-pvc.yaml"] = (
        f"The claim the repository is copied into ({_size(repository_bytes)} written, plus a quarter): "
        "ReadWriteMany so that every tritonserver pod mounts it (read-only) wherever it runs; fill it once "
        "(docs/deploy.md)",
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(claim, options, "repository"),
         "spec": {"accessModes": ["ReadWriteMany"],
                  "resources": {"requests": {"storage": _quantity(repository_bytes * 1.25 + 64 * MIB)}}}})
    hosts = ",".join([api, f"{api}.{options.namespace}", f"{api}.{options.namespace}.svc",
                      f"{api}.{options.namespace}.svc.cluster.local"])
    api_args = ["openai-api", "--triton-url", f"grpc://{triton}.{options.namespace}.svc:{PORTS['grpc']}",
                "--host", "0.0.0.0", "--port", str(API_PORT), "--allowed-hosts", hosts,
                "--state-dir", STATE_MOUNT, "--state-max-gb", f"{options.state_gb:g}"]
    api_mounts = [{"name": "state", "mountPath": STATE_MOUNT}]
    api_volumes: list[dict] = [{"name": "state", "persistentVolumeClaim": {"claimName": f"{api}-state"}}]
    api_pod_meta: dict[str, Any] = {"labels": _labels(name, "openai-api")}
    policies = overload_models(engines_yaml)
    if policies:
        text = Path(engines_yaml).read_text(encoding="utf-8")
        if len(text.encode()) > CONFIG_MAX_BYTES:
            raise ServeError(f"{engines_yaml} is over 1 MiB, more than a ConfigMap holds: the API's overload policies "
                             "cannot be shipped in one")
        api_args += ["--config", f"{CONFIG_MOUNT}/{CONFIG_FILE}"]
        api_mounts.append({"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True})
        api_volumes.append({"name": "config", "configMap": {"name": f"{api}-config"}})
        # a changed engines.yaml changes the pod template, so applying it again restarts the API with it
        api_pod_meta["annotations"] = {"trt-diffusion/config-sha256": hashlib.sha256(text.encode()).hexdigest()}
        out["openai-config.yaml"] = (
            f"engines.yaml as packaged, for the API's --config: the overload policies of {', '.join(policies)} "
            "(serving: overload:) apply to its online requests as they do on one host (docs/deploy.md)",
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{api}-config", options, "openai-api"),
             "data": {CONFIG_FILE: text}})
    out["openai-deployment.yaml"] = (
        "The OpenAI Images API in front of the Triton Service. ONE replica, replaced by Recreate: its job store is "
        "SQLite on the claim below, a single writer (one API process per state folder; docs/deploy.md)"
        + (f"; --config: the overload policies of {', '.join(policies)} from openai-config.yaml" if policies else ""),
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(api, options, "openai-api"),
         "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                  "selector": {"matchLabels": _selector(name, "openai-api")},
                  "template": {"metadata": api_pod_meta, "spec": {
                      "containers": [{
                          "name": "openai-api", "image": options.image, "command": ["trt-diffusion"],
                          "args": api_args,
                          # with this Secret, every request needs `Authorization: Bearer <key>`
                          "env": [{"name": "TRT_DIFFUSION_API_KEY", "valueFrom": {"secretKeyRef": {
                              "name": f"{api}-key", "key": "api-key", "optional": True}}}],
                          "ports": [{"name": "http", "containerPort": API_PORT, "protocol": "TCP"}],
                          # TCP: /health needs the API key when one is set, and the Host guard refuses a pod IP
                          "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 5},
                          "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10,
                                            "failureThreshold": 3},
                          "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
                          "securityContext": {"allowPrivilegeEscalation": False},
                          "volumeMounts": api_mounts,
                      }],
                      "volumes": api_volumes,
                  }}}})
    out["openai-service.yaml"] = (
        f"The API, as http://{api}.{options.namespace}.svc:{API_PORT}/v1 (another name, an Ingress's: add it to "
        "--allowed-hosts)",
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(api, options, "openai-api"),
         "spec": {"selector": _selector(name, "openai-api"),
                  "ports": [{"name": "http", "port": API_PORT, "targetPort": "http", "protocol": "TCP"}]}})
    out["openai-state-pvc.yaml"] = (
        f"The job store (SQLite, uploaded and result files): --state-max-gb {options.state_gb:g} plus 1 GiB. "
        "ReadWriteOnce: one writer",
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(f"{api}-state", options, "openai-api"),
         "spec": {"accessModes": ["ReadWriteOnce"],
                  "resources": {"requests": {"storage": _quantity(options.state_gb * GIB + GIB)}}}})
    if options.max_replicas is not None:
        out["triton-hpa.yaml"] = (
            "Scales tritonserver pods on Triton's nv_inference_pending_request_count (requests queued per pod). "
            "Needs a custom-metrics adapter (e.g. prometheus-adapter) serving that metric per pod",
            {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
             "metadata": _meta(triton, options, "triton"),
             "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": triton},
                      "minReplicas": options.replicas, "maxReplicas": options.max_replicas,
                      "metrics": [{"type": "Pods", "pods": {
                          "metric": {"name": "nv_inference_pending_request_count"},
                          "target": {"type": "AverageValue", "averageValue": str(pipeline_instances)}}}]}})
    return out


class _Dumper(yaml.SafeDumper):
    """Multi-line text (the ConfigMap's engines.yaml) as a literal block, readable in the manifest."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def render(comment: str, document: dict) -> str:
    lines = [MARKER] + [f"# {line}" for line in _wrap(comment)]
    return "\n".join(lines) + "\n" + yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=120)


def _wrap(text: str, width: int = 116) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]


def check_out_dir(out_dir: str | Path, repo: str | Path) -> Path:
    """The manifests' folder, refused (naming --kubernetes) when it is inside the repository or holds anything
    but manifests written here."""
    out_dir, repo = Path(out_dir).resolve(), Path(repo).resolve()
    if out_dir == repo or repo in out_dir.parents or out_dir in repo.parents:
        raise ServeError(f"--kubernetes {out_dir} must be outside the repository folder {repo} (and not above it)")
    if out_dir.exists() and not out_dir.is_dir():
        raise ServeError(f"--kubernetes {out_dir} exists and is not a folder")
    if out_dir.is_dir():
        foreign = [p.name for p in out_dir.iterdir() if not _written_here(p)]
        if foreign:
            raise ServeError(f"--kubernetes {out_dir} holds files not written by `package --kubernetes` "
                             f"({', '.join(sorted(foreign)[:3])}); choose another folder or empty it")
    return out_dir


def _written_here(path: Path) -> bool:
    if path.suffix != ".yaml" or not path.is_file() or path.is_symlink():
        return False
    with path.open(encoding="utf-8", errors="replace") as f:
        return f.readline().rstrip("\n") == MARKER


def write(out_dir: str | Path, repo: str | Path, report: Any, options: KubernetesOptions,
          engines_yaml: str | Path | None = None) -> list[Path]:
    """Write the manifests into `out_dir` (staged beside it, then renamed into place); their paths."""
    out_dir = check_out_dir(out_dir, repo)
    documents = manifests(repo, report, options, engines_yaml)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{os.getpid()}.", dir=out_dir.parent))
    try:
        for file_name, (comment, document) in documents.items():
            (staging / file_name).write_text(render(comment, document))
        swap_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [out_dir / file_name for file_name in documents]
