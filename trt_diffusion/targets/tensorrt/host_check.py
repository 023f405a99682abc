"""`python -m trt_diffusion.targets.tensorrt.host_check`: can this host run the gpu suite? One line, exit 0 or 1.

`make test-gpu` runs it before pytest, so a host without TensorRT, cuda-python or a CUDA device stops with
one message naming what is missing, instead of every gpu test failing with it.
"""

from __future__ import annotations

import argparse
import sys


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--note", default="", help="appended to the message when something is missing")
    args = parser.parse_args(argv)
    problems = missing()
    if problems:
        note = f" ({args.note})" if args.note else ""
        print(f"make test-gpu: this host cannot run the gpu suite: {'; '.join(problems)}{note}", file=sys.stderr)
        return 1
    from .engine import tensorrt_available

    print(f"make test-gpu: {tensorrt_available()[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
