"""Build time of the default engine matrix from scratch, and of a no-op rebuild.

    .venv/bin/python scripts/bench_build.py [engines.yaml]

Runs in a temporary workspace (the config's own build/ is untouched). Reports the in-process stage time
and the wall time of the `trt-diffusion build` command (interpreter start and imports included).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from trt_diffusion import api


def main() -> None:
    source = Path(sys.argv[1] if len(sys.argv) > 1 else "engines.yaml").resolve()
    data = yaml.safe_load(source.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for model in data["models"].values():  # keep model paths valid from the temp folder
            model["source"] = str((source.parent / model["source"]).resolve())
            for entry in list(model.get("controlnets", {}).values()) + list(model.get("loras", {}).values()):
                entry["source"] = str((source.parent / entry["source"]).resolve())
        data.setdefault("build", {})["workspace"] = str(Path(tmp) / "build")
        config = Path(tmp) / "engines.yaml"
        config.write_text(yaml.safe_dump(data))
        start = time.perf_counter()
        cold = api.build(config)
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        warm = api.build(config)
        noop_s = time.perf_counter() - start
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "trt_diffusion", "build", str(config)], check=True,
                       capture_output=True)
        noop_cli_s = time.perf_counter() - start
    print(f"engines: {len(cold.outcomes)} (built {len(cold.built)}), skipped targets: {cold.skipped_targets or '-'}")
    print(f"cold build (export + engines), in process: {cold_s:.1f} s")
    print(f"no-op rebuild, in process: {noop_s:.2f} s ({len(warm.cached)} engines reused)")
    print(f"no-op rebuild, `trt-diffusion build` wall time incl. interpreter and imports: {noop_cli_s:.1f} s")


if __name__ == "__main__":
    main()
