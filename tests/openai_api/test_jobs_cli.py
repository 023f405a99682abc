"""`openai-api` / `serve` with the job store's options: the folder's default under the user's state folder, a
corrupt store refused by name before anything listens (exit 1, no traceback), a quota that is not a size refused
as usage (exit 2)."""

from __future__ import annotations

import socket

from trt_diffusion.cli import EXIT_USAGE, main
from trt_diffusion.cli.openai_commands import state_options


def run(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_state_folder_defaults_under_the_users_state_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state_options(None, 2)["state_dir"] == tmp_path / "xdg" / "trt-diffusion"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert state_options(None, 2) == {"state_dir": tmp_path / "home" / ".local" / "state" / "trt-diffusion",
                                      "state_max_bytes": 2 * 1024**3}
    assert state_options(tmp_path / "mine", 0.5)["state_dir"] == tmp_path / "mine"


def test_a_corrupt_store_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "jobs.sqlite3").write_bytes(b"not sqlite" * 200)
    code, text = run(["openai-api", "--port", str(free_port()), "--state-dir", str(tmp_path)], capsys)
    assert code == 1 and "jobs.sqlite3 cannot be read" in text and "move it away" in text, text
    assert "Traceback" not in text


def test_quota_and_folder_mistakes(tmp_path, capsys):
    code, text = run(["openai-api", "--state-max-gb", "0"], capsys)
    assert code == EXIT_USAGE and "'--state-max-gb'" in text
    code, text = run(["serve", "--repo", str(tmp_path), "--state-dir", str(tmp_path)], capsys)
    assert code == 1 and "--state-dir is the OpenAI API's job store: give --openai-port too" in text, text
