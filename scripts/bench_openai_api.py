"""What the OpenAI Images API costs on top of Triton: the same request straight to the entry over gRPC and through
the API with the official `openai` client, per request and per denoise step.

Reuses bench_triton.py's tiny sd15 repository, starts the bundled tritonserver and the API on 127.0.0.1, then
times requests of several step counts both ways, interleaved; latency is fitted as a + b·steps. The API's `a`
minus Triton's is its overhead per request (HTTP + JSON, the asyncio gRPC call, PNG encoding and base64); `b`
should not differ (the API adds nothing per step). Also checks the decoded images are bit-equal.

    python scripts/bench_openai_api.py [--workdir build/bench-triton] [--runs 15] [--steps 2 10 30] [--json out.json]
"""

from __future__ import annotations

import base64
import io
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_triton's repository preparation and helpers
from bench_triton import SIZE, ServerTarget, fit, overhead_arguments, prepare_repository, time_targets  # noqa: E402


class ApiTarget:
    """One open `openai` client to the API."""

    def __init__(self, base_url: str, model: str):
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        self.model = model

    def __call__(self, steps: int) -> np.ndarray:
        from PIL import Image

        result = self.client.images.generate(model=self.model, prompt="a lighthouse", size=f"{SIZE}x{SIZE}",
                                             extra_body={"seed": 1, "num_inference_steps": steps})
        with Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))) as image:
            return np.asarray(image.convert("RGB"))

    def close(self) -> None:
        self.client.close()


def main(argv: list[str] | None = None) -> int:
    args = overhead_arguments(__doc__.splitlines()[0], argv)

    from trt_diffusion.openai_api.server import ApiServer
    from trt_diffusion.openai_api.settings import ApiSettings
    from trt_diffusion.triton.stage import start

    _, report, _, _ = prepare_repository(args.workdir, ensemble=False)
    server, _ = start(report.repo, work_dir=args.workdir / "server-openai", first_request=True)
    api = ApiServer(ApiSettings(server.grpc_url, port=0)).start()
    targets = {"triton grpc entry": ServerTarget(server.grpc_url, "grpc", report.entry),
               "openai api": ApiTarget(api.url, report.entry)}
    try:
        rows = time_targets(targets, args.steps, args.runs)
        equal = bool(np.array_equal(targets["triton grpc entry"](4), targets["openai api"](4)))
    finally:
        for target in targets.values():
            target.close()
        api.stop()
        server.stop()
    results = {}
    for name, samples in rows.items():
        best = [min(samples[s]) for s in args.steps]
        medians = [statistics.median(samples[s]) for s in args.steps]
        a, b = fit(args.steps, best)
        results[name] = {"a_ms": a * 1000, "b_ms": b * 1000, "best_ms": [x * 1000 for x in best],
                         "median_ms": [x * 1000 for x in medians]}
    base, through = results["triton grpc entry"], results["openai api"]
    summary = {"steps": args.steps, "runs": args.runs, "results": results, "bit_equal": equal,
               "overhead_per_request_ms": through["a_ms"] - base["a_ms"],
               "overhead_per_step_ms": through["b_ms"] - base["b_ms"]}
    for name, row in results.items():
        print(f"{name:18s} a {row['a_ms']:6.2f} ms  b {row['b_ms']:5.3f} ms/step  best {row['best_ms']}  "
              f"median {[round(x, 2) for x in row['median_ms']]}")
    print(f"API overhead: {summary['overhead_per_request_ms']:+.2f} ms per request, "
          f"{summary['overhead_per_step_ms']:+.3f} ms per step; images bit-equal: {equal}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
