"""The signing commands (issue 32): `keys generate`, `manifest --sign KEY`, `manifest --verify PUBKEY`,
`package --verify PUBKEY` through the CLI: exit 0 when the release verifies, 1 with one message when not."""

from __future__ import annotations

import shutil

from trt_diffusion.cli import main


def test_keys_sign_verify_and_package_through_the_cli(tmp_path, built_sd15, capsys):
    folder = tmp_path / "release"
    shutil.copytree(built_sd15.parent, folder, ignore=shutil.ignore_patterns("triton_repo*"))
    config = folder / "engines.yaml"
    key, other = tmp_path / "release.pem", tmp_path / "other.pem"
    assert main(["keys", "generate", str(key)]) == 0
    assert main(["keys", "generate", str(other)]) == 0
    assert main(["keys", "generate", str(key)]) == 1  # never overwrites a key
    assert main(["manifest", str(config), "--sign", str(key)]) == 0
    capsys.readouterr()
    assert main(["manifest", str(config), "--verify", str(tmp_path / "release.pub.pem")]) == 0
    assert main(["manifest", str(config), "--verify", str(tmp_path / "other.pub.pem")]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "not by any key given to --verify" in err and "Traceback" not in err
    assert main(["package", str(config), "--out", str(tmp_path / "repo"), "--verify",
                 str(tmp_path / "other.pub.pem"), "--verify", str(tmp_path / "release.pub.pem")]) == 0
    assert main(["package", str(config), "--out", str(tmp_path / "repo2"), "--verify",
                 str(tmp_path / "other.pub.pem")]) == 1
