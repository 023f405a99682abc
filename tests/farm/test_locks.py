"""One builder per engine key: two processes building one key make one valid artifact, and a lock left by
a dead builder expires."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from trt_diffusion.workspace.locks import engine_lock, is_stale, lock_path


def test_a_lock_of_a_dead_process_on_this_host_is_stale(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = lock_path(tmp_path, "k")
    path.parent.mkdir(parents=True)
    import socket

    path.write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "since": 0}))
    assert is_stale(path)
    with engine_lock(tmp_path, "k"):  # broken and taken at once
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists()


def test_a_lock_nobody_touches_expires(tmp_path):
    path = lock_path(tmp_path, "k")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"host": "another-host", "pid": 1, "since": 0}))
    assert not is_stale(path, stale_after_s=60)
    old = time.time() - 120
    os.utime(path, (old, old))
    assert is_stale(path, stale_after_s=60)
    assert not is_stale(path, stale_after_s=600)


def test_a_held_lock_is_waited_for(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from trt_diffusion.workspace.locks import engine_lock
        with engine_lock(Path({str(tmp_path)!r}), "k"):
            print("held", flush=True)
            time.sleep(1.5)
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with engine_lock(tmp_path, "k"):
        assert holder.poll() is not None  # the holder had finished and released it
    holder.wait()


@pytest.mark.slow
def test_two_processes_building_one_key_make_one_valid_engine(tmp_path, built_sd15):
    """Both start the same build at once into a fresh workspace: one builds, the other waits and reuses."""
    import shutil

    import yaml

    data = yaml.safe_load(built_sd15.read_text())
    data["build"]["workspace"] = str(tmp_path / "build")
    shutil.copytree(built_sd15.parent / "build" / "onnx", tmp_path / "build" / "onnx")
    config = tmp_path / "engines.yaml"
    config.write_text(yaml.safe_dump(data))
    script = textwrap.dedent(f"""
        import json
        from trt_diffusion import api
        report = api.build({str(config)!r}, component="unet")
        print(json.dumps([[o.spec.key, o.cached, o.error] for o in report.outcomes]))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    assert all(error is None for r in results for _, _, error in r)
    cached = sorted(c for r in results for _, c, _ in r)
    assert cached == [False, True]  # built once, reused once
    from trt_diffusion import api

    assert len(api.build(config, component="unet").cached) == 1
