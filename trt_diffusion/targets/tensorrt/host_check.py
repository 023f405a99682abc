"""`python -m trt_diffusion.targets.tensorrt.host_check`: which gpu suite can this host run? Exit 0 or 1.

`make test-gpu` runs it before pytest. A host without a CUDA device or without a CUDA build of torch stops
here (exit 1, one line naming what is missing): the gpu suite fails there, it never skips itself. A host with
CUDA but without TensorRT (or cuda-python) runs the CUDA-only gpu tests (`-m "gpu and not tensorrt"`) and the
suite then fails, saying TensorRT was missing. `--mode` prints `full` or `cuda-only` for the Makefile;
`--json FILE` writes what was found (scripts/gpu_check.sh puts it into its JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def torch_cuda_reason() -> str | None:
    """None when torch is a CUDA build that sees a device, else why not."""
    try:
        import torch
    except ImportError as err:
        return f"torch is not installed ({err})"
    if not torch.version.cuda:
        return f"torch {torch.__version__} is a CPU build (no CUDA): install a CUDA build of torch"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    return None


def missing() -> list[str]:
    """What this host lacks to build and run TensorRT engines with the production runner (empty: nothing)."""
    from .cudart import cuda_python_reason
    from .engine import tensorrt_available

    problems = []
    ok, reason = tensorrt_available()
    if not ok:
        problems.append(reason)
    cuda = cuda_python_reason()
    if cuda:
        problems.append(cuda)
    return problems


def host_status() -> dict:
    """{"mode": "full" | "cuda-only" | "none", "cuda": reason|None, "tensorrt": [reasons]}."""
    cuda = torch_cuda_reason()
    tensorrt = missing()
    mode = "none" if cuda else ("cuda-only" if tensorrt else "full")
    return {"mode": mode, "cuda": cuda, "tensorrt": tensorrt}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--note", default="", help="appended to the message when something is missing")
    parser.add_argument("--mode", action="store_true", help="print full | cuda-only on stdout (nothing else)")
    parser.add_argument("--json", type=Path, help="write the host's status here")
    args = parser.parse_args(argv)
    status = host_status()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**status, "note": args.note}, indent=1) + "\n")
    note = f" ({args.note})" if args.note else ""
    if status["mode"] == "none":
        print(f"make test-gpu: this host cannot run the gpu suite: {status['cuda']}{note}", file=sys.stderr)
        return 1
    if status["mode"] == "cuda-only":
        print(f"make test-gpu: TensorRT is missing, only the CUDA-only gpu tests run: "
              f"{'; '.join(status['tensorrt'])}{note}", file=sys.stderr)
    else:
        from .engine import tensorrt_available

        print(f"make test-gpu: {tensorrt_available()[1]}", file=sys.stderr)
    if args.mode:
        print(status["mode"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
