"""`serve --admin-apis` opens Triton's shared-memory, trace and logging APIs; without it they stay restricted
(issue 20, item 9). The CLI option reaches `stage.serve(admin_apis=...)`, which reaches tritonserver's command
line; the real server's answers to both are tested in test_restricted_apis.py."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from trt_diffusion.cli import app
from trt_diffusion.triton import stage
from trt_diffusion.triton.server import TritonServer


@pytest.fixture
def serve_calls(monkeypatch):
    calls = []

    def serve(repo, **kwargs):
        calls.append(kwargs)
        return None

    monkeypatch.setattr(stage, "serve", serve)
    return calls


@pytest.mark.parametrize("args, open_", [([], False), (["--admin-apis"], True)])
def test_the_serve_option_reaches_the_server(serve_calls, tmp_path, args, open_):
    result = CliRunner().invoke(app, ["serve", "--repo", str(tmp_path), *args])
    assert result.exit_code == 0, result.output
    assert [call["admin_apis"] for call in serve_calls] == [open_]
    assert ("--admin-apis: shared-memory, trace and logging APIs are open" in result.output) is open_


def test_serve_help_names_the_option():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert "--admin-apis" in result.output


@pytest.mark.parametrize("admin_apis", [False, True])
def test_the_command_line_restricts_unless_asked(tmp_path, admin_apis):
    args, _ = TritonServer(tmp_path / "repo", tmp_path / "work", admin_apis=admin_apis).command()
    restricted = [a for a in args if a.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))]
    assert len(restricted) == (0 if admin_apis else 2)
    assert all(a.split("=", 1)[1].startswith("shared-memory,trace,logging:") for a in restricted)
