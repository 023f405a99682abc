"""`build --ray` on a real Ray cluster started by the test: a head and two worker nodes with different
custom resources, in a network namespace that holds only loopback (Ray otherwise talks over the machine's
interface address even when told 127.0.0.1: docs/farm.md). Every engine is built once, on a node that has the resource engines.yaml
asks for, and its files equal a local build's. Needs root for `unshare -n` (CI and this machine run as
root); skipped with the reason where the namespace cannot be made."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray_loopback import farm_engines_yaml, results, run_on_loopback_cluster

pytestmark = pytest.mark.slow

pytest.importorskip("ray", reason="Ray is an extra: pip install 'trt-diffusion[farm]'")


DRIVER = """
import json, sys
from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.export import group_specs
from trt_diffusion.engine_builds.ray_executor import build_on_ray
import ray

ray.init(address="127.0.0.1:{port}", logging_level="ERROR", log_to_driver=False)
resources = {{node["NodeID"]: sorted(k for k in node["Resources"] if k in ("cpu_builder", "big_memory"))
             for node in ray.nodes() if node["Alive"]}}
config = load_engines_file(sys.argv[1])
specs = [s for s in api.plan(sys.argv[1], count_parameters=False).specs if s.target == "onnxruntime"]
nodes = {{}}
outcomes = build_on_ray(config, specs, address="127.0.0.1:{port}", prepare=api.engine_sources, nodes=nodes,
                       groups=[g.specs for g in group_specs(specs)])
print("RESULT=" + json.dumps({{
    "outcomes": [[o.spec.key, o.spec.component, o.cached, o.error, str(o.path)] for o in outcomes],
    "placed": {{key: resources.get(node, []) for key, node in nodes.items()}},
}}))
"""


def test_the_default_matrix_builds_across_nodes_each_engine_once_where_its_resource_is(tmp_path, built_sd15):
    data = farm_engines_yaml(tmp_path, built_sd15)
    data["build"]["farm"] = {"resources": {"onnxruntime/unet": {"big_memory": 1}, "onnxruntime": {"cpu_builder": 1}}}
    config = tmp_path / "engines.yaml"
    config.write_text(yaml.safe_dump(data))
    port = 6390
    (tmp_path / "driver.py").write_text(DRIVER.format(port=port))
    stdout = run_on_loopback_cluster(port, [{"cpu_builder": 1}, {"big_memory": 1}],
                                     [f"python {tmp_path / 'driver.py'} {config}"], timeout=600)
    (got,) = results(stdout)
    outcomes = got["outcomes"]
    assert len(outcomes) == 4 and all(error is None for _, _, _, error, _ in outcomes)
    assert all(not cached for _, _, cached, _, _ in outcomes)  # each engine built exactly once
    for key, component, _, _, _ in outcomes:
        assert got["placed"][key] == (["big_memory"] if component == "unet" else ["cpu_builder"])

    from trt_diffusion import api
    from trt_diffusion.workspace.files import sha256_file
    from trt_diffusion.workspace.provenance import engine_files

    local = {o.spec.key: o for o in api.build(built_sd15).outcomes}
    for key, _, _, _, path in outcomes:
        farm_files = {f.name: sha256_file(f) for f in engine_files(Path(path)) if "manifest" not in f.name}
        local_files = {f.name: sha256_file(f) for f in engine_files(local[key].path) if "manifest" not in f.name}
        assert farm_files == local_files
    assert not api.build(config).built  # the farm's engines are trusted by a plain build
