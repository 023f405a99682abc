"""Faults on a real Ray cluster (a head and two workers in a network namespace holding only loopback, as in
test_ray_cluster.py): the worker process building an engine is SIGKILLed while its half-written engine folder
exists. Without retries the engine is reported failed and nothing of it is trusted; with retries Ray runs the
task again, the retry breaks the dead builder's lock, and the build completes; afterwards every engine equals a
local build and a plain build builds nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray_loopback import farm_engines_yaml, results, run_on_loopback_cluster

pytestmark = pytest.mark.slow

pytest.importorskip("ray", reason="Ray is an extra: pip install 'trt-diffusion[farm]'")


DRIVER = """
import json, os, re, signal, sys, threading, time
from pathlib import Path
from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.targets import get_target
from trt_diffusion.export import group_specs
from trt_diffusion.engine_builds.ray_executor import build_on_ray
import ray

ray.init(address="127.0.0.1:{port}", logging_level="ERROR", log_to_driver=False)
config = load_engines_file(sys.argv[1])
workspace = Path(config.workspace)
killed = []

def kill_a_builder_mid_build():
    # A half-written engine folder (.<name>.<key>.XXXX) names its key; the key's lock names the worker process.
    engines, deadline = workspace / "engines" / "onnxruntime", time.time() + 300
    while time.time() < deadline:
        for temp in (sorted(engines.glob(".*")) if engines.is_dir() else []):
            key = next((p for p in temp.name.split(".") if re.fullmatch(r"[0-9a-f]{{16}}", p)), None)
            try:
                holder = json.loads((workspace / "locks" / f"{{key}}.lock").read_text())
                os.kill(int(holder["pid"]), signal.SIGKILL)
            except (OSError, ValueError, KeyError):
                continue
            killed.append({{"key": key, "pid": holder["pid"], "temp": temp.name}})
            return
        time.sleep(0.002)

killer = threading.Thread(target=kill_a_builder_mid_build, daemon=True)
killer.start()
specs = [s for s in api.plan(sys.argv[1], count_parameters=False).specs if s.target == "onnxruntime"]
outcomes = build_on_ray(config, specs, address="127.0.0.1:{port}", prepare=api.engine_sources,
                       groups=[g.specs for g in group_specs(specs)])
killer.join(timeout=5)
print("RESULT=" + json.dumps({{
    "killed": killed,
    "outcomes": [[o.spec.key, o.cached, o.error, str(o.path) if o.path else None] for o in outcomes],
    "left": sorted(p.name for p in (workspace / "engines" / "onnxruntime").glob(".*")),
    "trusted": {{s.key: get_target(s.target).find(workspace, s) is not None for s in specs}},
    "manifest": {{e["key"]: e["status"] for e in api.manifest(sys.argv[1])["engines"]}},
}}))
"""


def test_a_worker_killed_mid_build_is_reported_or_retried_and_a_rerun_completes(tmp_path, built_sd15):
    data = farm_engines_yaml(tmp_path, built_sd15)
    no_retries, retries = tmp_path / "no-retries" / "engines.yaml", tmp_path / "retries" / "engines.yaml"
    for path, count in ((no_retries, 0), (retries, 2)):
        path.parent.mkdir()
        path.write_text(yaml.safe_dump({**data, "build": {**data["build"], "farm": {"max_retries": count}}}))
    port = 6391
    (tmp_path / "driver.py").write_text(DRIVER.format(port=port))
    stdout = run_on_loopback_cluster(port, [{}, {}], [f"python {tmp_path / 'driver.py'} {no_retries}",
                                                      f"python {tmp_path / 'driver.py'} {retries}"], timeout=900)
    first, second = results(stdout)

    from trt_diffusion import api
    from trt_diffusion.workspace.files import sha256_file
    from trt_diffusion.workspace.provenance import engine_files

    # no retries: the killed engine is reported, the others are built, its half-written folder is not trusted
    assert len(first["killed"]) == 1, first
    killed = first["killed"][0]["key"]
    errors = {key: error for key, _, error, _ in first["outcomes"]}
    assert len(errors) == 4 and errors[killed] and "failed after 0 retries" in errors[killed]
    assert all(error is None for key, error in errors.items() if key != killed)
    assert first["killed"][0]["temp"] in first["left"]  # what the dead builder was writing is still there …
    assert first["trusted"] == {key: key != killed for key in errors}  # … and nothing trusts it
    assert first["manifest"][killed] == "missing"

    # retries: the rerun's one build is killed too; Ray runs it again, which completes it
    assert len(second["killed"]) == 1 and second["killed"][0]["key"] == killed, second
    outcomes = {key: (cached, error) for key, cached, error, _ in second["outcomes"]}
    assert all(error is None for _, error in outcomes.values()), second
    assert outcomes[killed] == (False, None)  # built, by the retry
    assert all(cached for key, (cached, _) in outcomes.items() if key != killed)
    assert second["left"] == []  # the retry removed the dead builders' temporaries under the key's lock

    local = {o.spec.key: o for o in api.build(built_sd15).outcomes}
    for key, _, _, path in second["outcomes"]:
        farm = {f.name: sha256_file(f) for f in engine_files(Path(path)) if "manifest" not in f.name}
        here = {f.name: sha256_file(f) for f in engine_files(local[key].path) if "manifest" not in f.name}
        assert farm == here
    assert not api.build(retries).built
    assert api.manifest(retries)["counts"]["ok"] == 4
