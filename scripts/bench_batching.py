"""Throughput at concurrency 8 with dynamic batching vs without, same engines and instance count (issue 18).

Builds onnxruntime engines of a model at batch 1, 2 and 4 (the tiny default, or a full-size SD1.5 folder with
--model-dir), packages it twice (batching off: --batch-requests 1; on: package's default — as many requests as one call
of the biggest UNet engine takes — with the default 5 ms delay), and for each runs 8 closed-loop gRPC clients for --seconds, different prompts and seeds. Reports
requests/s, P50 and P99 latency, the ratio, and checks a batched image equals the unbatched one.

    python scripts/bench_batching.py [--workdir build/bench-batching] [--seconds 20] [--steps 20] [--size 64]
        [--model-dir models/tiny-sd15] [--batches 1,2,4] [--json out.json]
    # full size:  --model-dir <SD1.5 folder> --size 256 --steps 20 --seconds 60 --instances 1 --batches 1,2
    #             --warmup-seconds 0 --queue-timeout 3600  (three 3.4 GB UNet engines per instance do not
    #             fit 24 GiB twice; one request takes ~40 s on 2 cores, so 8 clients queue for minutes)
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import yaml

PROMPTS = ["a lighthouse on a cliff at dusk", "a red fox in snow", "an old tram in Lisbon", "a bowl of ramen",
           "a paper boat", "a desert at noon", "a glass of water", "a violin on a chair"]


def build(workdir: Path, model_dir: Path, size: int, batches: list[int]) -> list:
    from trt_diffusion import api
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import built_engines

    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "engines.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": str(workdir.resolve() / "build")}, "models": {
        "sd15": {"source": str(model_dir.resolve()), "family": "sd15", "buckets": [f"{size}x{size}"],
                 "batch": batches, "targets": ["onnxruntime"],
                 "components": ["text_encoder", "unet", "vae_decoder"],
                 "precision": {"text_encoder": "fp32", "unet": "fp32", "vae_decoder": "fp32"}}}}))
    api.build(config, target="onnxruntime")
    return built_engines(load_engines_file(config, check_sources=True), "sd15", "onnxruntime")


def run(url: str, entry: str, size: int, steps: int, seconds: float, concurrency: int) -> dict:
    from trt_diffusion.triton.client import ImageRequest, client_module, connect, infer

    module = client_module("grpc")
    latencies: list[float] = []
    errors: list[str] = []
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def worker(k: int) -> None:
        client = connect(url, "grpc")
        n = 0
        try:
            while time.monotonic() < stop:
                request = ImageRequest(PROMPTS[(k + n) % len(PROMPTS)], size, size, steps=steps, seed=k * 1000 + n)
                start = time.perf_counter()
                try:
                    infer(client, module, entry, request, protocol="grpc", timeout_s=600, url=url)
                    with lock:
                        latencies.append(time.perf_counter() - start)
                except Exception as err:  # noqa: BLE001 - counted
                    with lock:
                        errors.append(str(err)[:200])
                n += 1
        finally:
            client.close()

    begin = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - begin
    ordered = sorted(latencies)
    return {"requests": len(latencies), "errors": len(errors), "first_error": errors[0] if errors else None,
            "seconds": elapsed,
            "requests_per_s": len(latencies) / elapsed, "p50_s": statistics.median(ordered),
            "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("build/bench-batching"))
    parser.add_argument("--model-dir", type=Path, default=Path("models/tiny-sd15"))
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup-seconds", type=float, default=5.0, help="closed-loop warm-up before timing")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--batches", default="1,2,4", help="engine batches engines.yaml declares (CFG doubles them)")
    parser.add_argument("--queue-timeout", type=float, default=60.0,
                        help="seconds a request may wait queued (raise it where one request takes tens of seconds)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from trt_diffusion.triton import stage
    from trt_diffusion.triton.client import ImageRequest, generate_images
    from trt_diffusion.triton.repository import PackageOptions, package

    if not (args.model_dir / "model_index.json").is_file():
        from trt_diffusion.models.tiny import write_tiny_model

        write_tiny_model(args.model_dir, "sd15")
    batches = [int(b) for b in args.batches.split(",")]
    engines = build(args.workdir, args.model_dir, args.size, batches)
    results, images = {}, {}
    probe = ImageRequest(PROMPTS[0], args.size, args.size, steps=args.steps, seed=7)
    for mode, batch_requests in (("unbatched", 1), ("batched", None)):  # None: package's default
        repo = args.workdir / f"repo-{mode}"
        package(engines, args.model_dir, "sd15", "sd15", repo,
                PackageOptions(ensemble=False, stream=False, pipeline_instances=args.instances,
                               batch_requests=batch_requests, max_queue_size=64,
                               queue_timeout_s=args.queue_timeout))
        server, _ = stage.start(repo, first_request=False)
        try:
            if args.warmup_seconds > 0:  # the engines' own warm-up ran at load; this also warms the clients
                run(server.grpc_url, "sd15", args.size, args.steps, args.warmup_seconds, args.concurrency)
            results[mode] = run(server.grpc_url, "sd15", args.size, args.steps, args.seconds, args.concurrency)
            images[mode] = generate_images(server.grpc_url, probe, pipeline="sd15", protocol="grpc")[0]
        finally:
            server.stop()
        print(mode, json.dumps(results[mode]))
    summary = {"size": args.size, "steps": args.steps, "batches": batches, "concurrency": args.concurrency,
               "instances": args.instances,
               "model_dir": str(args.model_dir), **results,
               "throughput_ratio": results["batched"]["requests_per_s"] / results["unbatched"]["requests_per_s"],
               "p99_ratio": results["batched"]["p99_s"] / results["unbatched"]["p99_s"],
               "same_image": bool(np.array_equal(images["batched"], images["unbatched"]))}
    print(json.dumps({k: summary[k] for k in ("throughput_ratio", "p99_ratio", "same_image")}))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
