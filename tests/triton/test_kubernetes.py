"""`package --kubernetes DIR`: the manifests of the tiny sd15 repository, through the real command, checked against
the Kubernetes OpenAPI schemas of a fixed release (kubernetes-validate, strict: an unknown field fails too)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from trt_diffusion.cli.main import main
from trt_diffusion.triton.kubernetes import MARKER
from trt_diffusion.triton.report import PackageReport

kubernetes_validate = pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.triton

KUBERNETES = "1.33.0"  # a release the pinned kubernetes-validate carries the schemas of


def _validate(document: dict) -> None:
    kubernetes_validate.validate(document, KUBERNETES, strict=True)


@pytest.fixture(scope="module")
def packaged(built_sd15, tmp_path_factory):
    root = tmp_path_factory.mktemp("k8s")
    code = main(["package", str(built_sd15), "--out", str(root / "repo"), "--no-ensemble", "--kubernetes",
                 str(root / "k8s"), "--replicas", "2", "--max-replicas", "4", "--namespace", "imaging"])
    assert code == 0
    documents = {path.name: yaml.safe_load(path.read_text()) for path in sorted((root / "k8s").iterdir())}
    return root, documents


def test_every_manifest_validates_against_the_schemas(packaged):
    root, documents = packaged
    assert set(documents) == {"triton-deployment.yaml", "triton-service.yaml", "triton-pdb.yaml", "triton-hpa.yaml",
                              "repository-pvc.yaml", "openai-deployment.yaml", "openai-service.yaml",
                              "openai-state-pvc.yaml"}
    for name, document in documents.items():
        assert (root / "k8s" / name).read_text().startswith(MARKER + "\n")
        _validate(document)


def test_the_manifests_serve_the_repository(packaged):
    root, documents = packaged
    report = PackageReport.read(root / "repo")
    triton = documents["triton-deployment.yaml"]
    assert triton["spec"]["replicas"] == 2 and triton["metadata"]["namespace"] == "imaging"
    container = triton["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8000, "grpc": 8001,
                                                                            "metrics": 8002}
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "repository")
    assert mount["readOnly"] is True and "--model-repository=/models" in container["command"][-1]
    # onnxruntime engines: no GPU; the memory request is the repository's recorded estimate
    assert "limits" not in container["resources"]
    estimate_mib = sum(share["total_gb"] for share in report.memory) * 1e9 / 2**20
    assert 0 <= int(container["resources"]["requests"]["memory"].removesuffix("Mi")) - estimate_mib < 1
    api = documents["openai-deployment.yaml"]
    assert api["spec"]["replicas"] == 1 and api["spec"]["strategy"] == {"type": "Recreate"}
    args = api["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--triton-url") + 1] == "grpc://sd15-tiny-triton.imaging.svc:8001"
    assert args[args.index("--state-dir") + 1] == "/var/lib/trt-diffusion"
    claim = api["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == documents["openai-state-pvc.yaml"]["metadata"]["name"]
    assert documents["triton-hpa.yaml"]["spec"]["maxReplicas"] == 4


def test_the_check_refuses_a_broken_manifest(packaged):
    """The same check fails: a misspelt field (strict) and a wrong type are refused."""
    _, documents = packaged
    misspelt = copy.deepcopy(documents["triton-deployment.yaml"])
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/v2/health/ready"
    wrong_type = copy.deepcopy(documents["openai-service.yaml"])
    wrong_type["spec"]["ports"][0]["port"] = "eighty"
    for broken in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            _validate(broken)


@pytest.mark.parametrize("option,value,expected", [
    ("--replicas", "0", "--replicas must be at least 1, got 0"),
    ("--kubernetes-name", "Not_A_Label", "--kubernetes-name 'Not_A_Label' is not a DNS-1123 label"),
    ("--namespace", "a.b", "--namespace 'a.b' is not a DNS-1123 label"),
])
def test_a_bad_value_is_one_error_naming_the_option_and_nothing_is_written(built_sd15, tmp_path, capsys, option,
                                                                           value, expected):
    code = main(["package", str(built_sd15), "--out", str(tmp_path / "repo"), "--kubernetes", str(tmp_path / "k8s"),
                 option, value])
    assert code == 1
    assert expected in capsys.readouterr().err.replace("\n", "")
    assert list(tmp_path.iterdir()) == []


def test_kubernetes_options_need_the_folder(built_sd15, tmp_path, capsys):
    assert main(["package", str(built_sd15), "--out", str(tmp_path / "repo"), "--replicas", "3"]) == 1
    assert "--replicas is an option of the Kubernetes manifests: give --kubernetes DIR too" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_foreign_folder_is_not_replaced(built_sd15, tmp_path, capsys):
    (tmp_path / "k8s").mkdir()
    (tmp_path / "k8s" / "mine.yaml").write_text("kind: ConfigMap\n")
    assert main(["package", str(built_sd15), "--out", str(tmp_path / "repo"), "--kubernetes",
                 str(tmp_path / "k8s")]) == 1
    assert "holds files not written by `package --kubernetes` (mine.yaml)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k8s"]
    assert [p.name for p in Path(tmp_path / "k8s").iterdir()] == ["mine.yaml"]


def test_engine_models_on_a_gpu_ask_for_one(packaged, tmp_path):
    """A repository whose engine models run KIND_GPU (TensorRT's) gets `nvidia.com/gpu: 1`, still valid."""
    import shutil

    from trt_diffusion.triton import kubernetes

    root, _ = packaged
    repo = tmp_path / "repo"
    shutil.copytree(root / "repo", repo)
    report = PackageReport.read(repo)
    engine = next(m.name for m in report.models if m.role == "engine")
    config = repo / engine / "config.pbtxt"
    assert "KIND_CPU" in config.read_text()
    config.write_text(config.read_text().replace("KIND_CPU", "KIND_GPU"))
    kubernetes.write(tmp_path / "k8s", repo, report, kubernetes.KubernetesOptions())
    document = yaml.safe_load((tmp_path / "k8s" / "triton-deployment.yaml").read_text())
    container = document["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert "--allow-gpu-metrics=true" in container["command"][-1]
    _validate(document)


def _with_overload(built_sd15, folder: Path, overload: dict) -> Path:
    """A copy of the built engines.yaml (same workspace) whose model declares `serving: overload:`."""
    document = yaml.safe_load(Path(built_sd15).read_text())
    document["build"]["workspace"] = str((Path(built_sd15).parent / document["build"]["workspace"]).resolve())
    (model,) = document["models"].values()
    model["serving"] = {"overload": overload}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "engines.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def test_an_overload_policy_ships_engines_yaml_to_the_api(built_sd15, packaged, tmp_path):
    """With a `serving: overload:` policy the API runs `--config` on engines.yaml from a ConfigMap mounted into its
    pod, and that file gives the API the same policy; without one (the fixture) neither is written."""
    from trt_diffusion.cli.openai_commands import overload_options
    from trt_diffusion.openai_api.overload import OverloadPolicy
    from trt_diffusion.triton.naming import entry_name

    config = _with_overload(built_sd15, tmp_path / "config",
                            {"degrade_after_s": 20, "refuse_after_s": 60, "degrade": {"steps": 4}})
    assert main(["package", str(config), "--out", str(tmp_path / "repo"), "--no-ensemble", "--kubernetes",
                 str(tmp_path / "k8s"), "--namespace", "imaging"]) == 0
    documents = {path.name: yaml.safe_load(path.read_text()) for path in sorted((tmp_path / "k8s").iterdir())}
    for document in documents.values():
        _validate(document)
    shipped = documents["openai-config.yaml"]
    assert shipped["kind"] == "ConfigMap" and shipped["metadata"]["namespace"] == "imaging"
    assert shipped["data"] == {"engines.yaml": config.read_text()}
    pod = documents["openai-deployment.yaml"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["args"][container["args"].index("--config") + 1] == "/etc/trt-diffusion/engines.yaml"
    assert {"name": "config", "mountPath": "/etc/trt-diffusion", "readOnly": True} in container["volumeMounts"]
    assert {"name": "config", "configMap": {"name": shipped["metadata"]["name"]}} in pod["spec"]["volumes"]
    assert len(pod["metadata"]["annotations"]["trt-diffusion/config-sha256"]) == 64  # a changed file restarts it
    # what `openai-api --config` reads in the pod, where the model sources are not: the same policy
    in_pod = tmp_path / "pod" / "engines.yaml"
    in_pod.parent.mkdir()
    in_pod.write_text(shipped["data"]["engines.yaml"])
    (model,) = yaml.safe_load(config.read_text())["models"]
    assert overload_options(in_pod) == {"overload": ((entry_name(model), OverloadPolicy(20, 60, 4, None)),)}
    _, without = packaged
    assert "openai-config.yaml" not in without
    assert "--config" not in without["openai-deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_a_policy_the_api_would_refuse_is_refused_before_anything_is_written(built_sd15, tmp_path, capsys):
    config = _with_overload(built_sd15, tmp_path / "config", {"degrade_after_s": 20, "degrade": {"size": "32x32"}})
    assert main(["package", str(config), "--out", str(tmp_path / "repo"), "--kubernetes", str(tmp_path / "k8s")]) == 1
    assert "degrade.size: 32x32 is not a size" in capsys.readouterr().err.replace("\n", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config"]
