"""Preflight against the real tritonserver (one per module): the whole list passes over --url (gRPC) with its
figures in preflight.json; HTTP reports cancellation n/a; an unbounded queue fails the overload check; bad input
(no baseline, a baseline of other engines, an unreachable URL, a server serving another model) is one message,
exit 1 and nothing written."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from trt_diffusion.checklist import CHECK_NAMES
from trt_diffusion.cli import main
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.preflight import connect
from trt_diffusion.preflight.checks.base import CheckContext
from trt_diffusion.preflight.run import run_check

# Its own server and the whole checklist over --url (about 45 s); the in-process preflight tests stay by default.
pytestmark = [pytest.mark.triton, pytest.mark.slow, pytest.mark.timeout(600)]

UNBOUNDED = "sd15-unbounded"


@pytest.fixture(scope="module")
def served(preflight_yaml, tmp_path_factory):
    """The built engines packaged as preflight packages them (no ensemble), plus a second entry over the same
    engines whose queue has no practical bound (a test-side edit of the written repository)."""
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.repository import PackageOptions, package

    path = preflight_yaml()
    config = load_engines_file(path)
    engines = connect.find_engines(config, "sd15-tiny", "onnxruntime")
    model = config.models["sd15-tiny"]
    root = tmp_path_factory.mktemp("preflight-served")
    repo = root / "repo"
    package(connect.servable(engines), model.source.path, model.family, "sd15-tiny", repo,
            PackageOptions(ensemble=False))
    shutil.copytree(repo / "sd15-tiny", repo / UNBOUNDED)
    pbtxt = repo / UNBOUNDED / "config.pbtxt"
    text = pbtxt.read_text().replace('name: "sd15-tiny"', f'name: "{UNBOUNDED}"')
    pbtxt.write_text(re.sub(r"max_queue_size: \d+", "max_queue_size: 1000000", text))
    server, _ = stage.start_server(repo, root / "work", (None, None, None), 600.0, False)
    try:
        yield server, path
    finally:
        server.stop()


def run_cli(*args) -> int:
    return main(["preflight", *map(str, args)])


def test_whole_list_passes_over_url_and_lists_all_eight(served, tmp_path, capsys):
    server, path = served
    metrics = f"127.0.0.1:{server.ports.metrics}"
    # what `make preflight` runs first: saves the baseline where this file keeps it, as none is there yet
    assert run_cli(path, "--url", server.grpc_url, "--metrics-url", metrics, "--only", "quality",
                   "--save-baseline-if-missing", "--out", tmp_path / "saving") == 0
    out = tmp_path / "report"
    code = run_cli(path, "--url", server.grpc_url, "--metrics-url", metrics, "--out", out)
    printed = capsys.readouterr()
    report = json.loads((out / "preflight.json").read_text())
    assert code == 0, (printed.out[-3000:], printed.err[-2000:])
    assert [c["name"] for c in report["checks"]] == list(CHECK_NAMES) and report["passed"]
    checks = {c["name"]: c for c in report["checks"]}
    assert {c["status"] for c in checks.values()} == {"pass"}, {n: c["failures"] for n, c in checks.items()}
    assert checks["quality"]["figures"]["min_psnr_db"] == "Infinity"
    assert checks["memory"]["figures"]["source"].startswith("RSS of the server's process tree")  # found by port
    cancel = checks["cancellation"]["figures"]
    assert cancel["denoiser_calls_after_deadline"] < cancel["denoiser_calls_if_not_cancelled"]
    overload = checks["overload"]["figures"]
    assert overload["capacity_rps"] > 0 and overload["errors"] == 0 and overload["hung"] == 0
    assert overload["sent"] == overload["accepted"] + overload["refused"]
    assert "policy_offered" not in overload  # no `serving: overload:` here: a note says so
    assert any("declares no `serving: overload:` policy" in note for note in checks["overload"]["notes"])
    assert report["deployment"]["kind"] == "served" and not report["deployment"]["started_by_preflight"]
    assert (out / "preflight.html").is_file() and (out / "preflight.schema.json").is_file()


def test_http_cannot_cancel_so_cancellation_is_na(served, tmp_path):
    server, path = served
    assert run_cli(path, "--url", server.http_url, "--protocol", "http", "--only", "cancellation",
                   "--out", tmp_path) == 0
    check = json.loads((tmp_path / "preflight.json").read_text())["checks"][0]
    assert check["status"] == "n/a" and "HTTP Triton cannot cancel" in check["reason"]


@pytest.mark.slow  # drives the server past its capacity (~13 s)
def test_overload_fails_with_an_unbounded_queue(served, preflight_yaml):
    server, _ = served
    # 2x the measured capacity: overloaded even where a busy machine makes the capacity look low
    # with an API overload policy, which Triton alone does not apply: the check simulates it beside its load run
    path = preflight_yaml({"overload": {"load_factor": 2.0, "duration_s": 5.0}},
                          {"serving": {"overload": {"degrade_after_s": 0.2, "refuse_after_s": 1.0,
                                                    "degrade": {"steps": 4}}}})
    config = load_engines_file(path)
    engines = connect.find_engines(config, "sd15-tiny", "onnxruntime")

    def overload(entry: str):
        deployment = connect.connect_served(server.grpc_url, "grpc", config, engines)
        deployment.entry = entry
        try:
            return run_check("overload", CheckContext(config, "sd15-tiny", "onnxruntime", config.preflight,
                                                      deployment, engines))
        finally:
            deployment.close()

    # (the bounded entry passes the same check in test_whole_list_passes_over_url_and_lists_all_eight)
    unbounded = overload(UNBOUNDED)
    assert unbounded.status == "fail", unbounded.figures
    assert unbounded.figures["refused"] == 0
    assert any("waits grow without bound" in f for f in unbounded.failures), unbounded.failures
    figures = unbounded.figures
    assert figures["policy_offered"] == figures["sent"] == (figures["policy_as_asked"] + figures["policy_degraded"]
                                                            + figures["policy_refused"])
    assert "overload policy (simulated over the measured service time)" in unbounded.summary


# ---------------------------------------------------------------------------- bad input


def assert_refused(capsys, code: int, message: str, out) -> None:
    err = capsys.readouterr().err
    assert code == 1 and message in " ".join(err.split()), err
    assert sum(line.startswith("error:") for line in err.splitlines()) == 1
    assert not out.exists()  # nothing half-written


def test_missing_baseline(preflight_yaml, tmp_path, capsys):
    out = tmp_path / "report"
    assert_refused(capsys, run_cli(preflight_yaml(), "--url", "127.0.0.1:1", "--out", out),
                   "no quality baseline at", out)


def test_baseline_of_other_engines(preflight_yaml, tmp_path, capsys):
    import numpy as np

    from trt_diffusion.preflight.baseline import Baseline, folder_for, save_baseline

    path = preflight_yaml()
    config = load_engines_file(path)
    keys = [e.spec.key for e in connect.servable(connect.find_engines(config, "sd15-tiny", "onnxruntime"))]
    quality = config.preflight.quality
    images = {("txt2img", p, s): np.zeros((64, 64, 3), np.uint8) for p in quality.prompts for s in quality.seeds}
    save_baseline(Baseline(folder_for(config, "sd15-tiny", config.preflight), "sd15-tiny", "onnxruntime",
                           ["0123456789abcdef", *keys[1:]], "64x64", quality.steps, quality.guidance_scale, images))
    out = tmp_path / "report"  # refused before connecting: the URL is never tried
    assert_refused(capsys, run_cli(path, "--url", "127.0.0.1:1", "--out", out), "was saved from other engines", out)


def test_unreachable_url(preflight_yaml, tmp_path, capsys):
    from trt_diffusion.triton.server import free_port

    out = tmp_path / "report"
    url = f"127.0.0.1:{free_port()}"
    assert_refused(capsys, run_cli(preflight_yaml(), "--url", url, "--skip", "quality", "--out", out),
                   f"cannot reach Triton at {url}", out)


def test_server_serving_another_model(served, preflight_yaml, tmp_path, capsys, monkeypatch):
    server, _ = served
    path = preflight_yaml(rename="other-tiny")
    real = connect.find_engines

    def built_as_other(config, model, target):  # other-tiny's engines "are built": the sd15-tiny ones, renamed
        engines = real(load_engines_file(served[1]), "sd15-tiny", target)
        return connect.Engines(model, target, engines.found, engines.missing)

    monkeypatch.setattr(connect, "find_engines", built_as_other)
    out = tmp_path / "report"
    assert_refused(capsys, run_cli(path, "--url", server.grpc_url, "--skip", "quality", "--out", out),
                   "serves sd15-tiny, sd15-unbounded, not other-tiny", out)
