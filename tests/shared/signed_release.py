"""A signed copy of a built workspace, as a release host makes it: the tests of signed releases and sealed
repositories start from one."""

from __future__ import annotations

import shutil
from pathlib import Path


def signed_workspace_copy(built_config: Path, root: Path) -> tuple[Path, Path, Path]:
    """Copy `built_config`'s folder (its workspace built) into `root/release`, make its release manifest (verified)
    and sign it with a new key in `root/keys`: (engines.yaml of the copy, private key, public key)."""
    from trt_diffusion import api, signing

    folder = root / "release"
    shutil.copytree(built_config.parent, folder, ignore=shutil.ignore_patterns("triton_repo*"))
    config = folder / "engines.yaml"
    api.manifest(config)
    private, public, _ = signing.generate_keys(root / "keys" / "release.pem")
    signing.sign_release_file(folder / "build" / signing.RELEASE_FILE, private)
    return config, private, public
