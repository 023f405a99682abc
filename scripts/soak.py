"""Soak: mixed load on one server for a bounded time — several models, LoRA switching, cancellations, bad
requests, over Triton's HTTP and gRPC and the OpenAI Images API (issue 28).

One repository serves two tiny models (sd15 with two refit LoRAs switched per request, and sdxl), one tritonserver
and the OpenAI API in front of it, all on 127.0.0.1. Before the clock starts, every (model, LoRA set, seed) a good
request can ask for is generated once over gRPC: those images are the references, and the warm-up fills every
instance's LoRA cache. Then `--clients` threads send, for `--minutes`, a seeded mix of:

- good requests (gRPC, HTTP, OpenAI; a random model, LoRA set and seed): each image must equal its reference bit for
  bit — anything else (an error, another image) is a failure;
- bad requests (a LoRA the repository does not serve, malformed LORAS, a size no bucket has, an unknown body field,
  an unknown model): each must be refused with its own message — one that is served is a failure;
- cancellations (a long request whose client gives up after a fraction of a second, over gRPC and the OpenAI API):
  each must end on the client's deadline.

The server's process tree (tritonserver and its python backend stubs) is sampled every few seconds: its RSS and the
anonymous part of it, which is what a leak grows (file-backed pages come and go with other processes' pressure).
The first `--settle-minutes` of load are not measured: concurrent requests reach shapes the sequential warm-up does
not (batch-2 calls, cancelled runs), and the runtimes' arenas grow to them once (measured: +140 MB anonymous in the
first minute, then +2 MB over the next 19). The drift is the median of the last minute minus the median of the first
minute after that; the bound applies to the anonymous part. Exit status 1 when any good
request failed, any bad one was served, a cancelled one hung, or the drift passed `--max-drift-mb`.

    python scripts/soak.py [--minutes 20] [--settle-minutes 1] [--clients 3] [--workdir build/soak] \\
        [--max-drift-mb 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

SIZE = 64
STEPS = 2
PROMPT = "a lighthouse on a cliff at dusk"
SEEDS = (0, 1)
LORA_SETS = {  # the LORAS values good requests send to the model that serves LoRAs (None: the base model)
    "base": None,
    "style": [{"name": "style", "scale": 1.0}],
    "detail": [{"name": "detail", "scale": 0.7}],
    "both": [{"name": "detail", "scale": 0.5}, {"name": "style", "scale": 0.5}],
}
LONG_STEPS = 400  # a request only a cancellation ends early
CANCEL_AFTER_S = 0.4
HANG_GUARD_S = 30.0  # a cancelled request must end well before this
SAMPLE_EVERY_S = 5.0
DEFAULT_MAX_DRIFT_MB = 128


def prepare(workdir: Path) -> Path:
    """engines.yaml of the tiny sd15 (two refit LoRAs) and the tiny sdxl at 64x64, onnxruntime engines built (reused
    when already there). Returns the engines.yaml path."""
    import torch
    from safetensors.torch import load_file, save_file

    from trt_diffusion import api
    from trt_diffusion.models.tiny import write_tiny_model

    workdir.mkdir(parents=True, exist_ok=True)
    sd15, sdxl = workdir / "sd15-tiny", workdir / "sdxl-tiny"
    if not (sd15 / "model_index.json").is_file():
        write_tiny_model(sd15, "sd15", lora=True, overwrite=True)
    if not (sdxl / "model_index.json").is_file():
        write_tiny_model(sdxl, "sdxl", overwrite=True)
    style = sd15 / "lora" / "pytorch_lora_weights.safetensors"
    detail = workdir / "detail.safetensors"
    if not detail.is_file():  # the same layers, other seeded values: a clearly different second LoRA
        generator = torch.Generator().manual_seed(28)
        save_file({key: torch.randn(value.shape, generator=generator) * value.float().std() * 2
                   for key, value in sorted(load_file(str(style)).items())}, str(detail))
    def common() -> dict:  # fresh lists per model: engines.yaml refuses YAML aliases
        return {"buckets": [f"{SIZE}x{SIZE}"], "batch": [1, 2], "targets": ["onnxruntime"]}

    config = workdir / "engines.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build"}, "models": {
        "sd15-tiny": {"source": str(sd15.resolve()), "family": "sd15", **common(),
                      "loras": {"style": {"source": str(style.resolve()), "mode": "refit"},
                                "detail": {"source": str(detail.resolve()), "mode": "refit"}}},
        "sdxl-tiny": {"source": str(sdxl.resolve()), "family": "sdxl", **common()},
    }}, sort_keys=False))
    report = api.build(config, target="onnxruntime")
    if report.failed:
        raise SystemExit(f"build failed: {[o.error for o in report.failed]}")
    return config


@dataclass
class Tally:
    """What the clients saw, by kind of request and outcome; failures keep a few messages."""
    counts: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str, message: str = "") -> None:
        with self.lock:
            self.counts[f"{kind}:{outcome}"] += 1
            if outcome == "failed" and len(self.failures) < 20:
                self.failures.append(f"{kind}: {message[:300]}")

    def total(self, outcome: str) -> int:
        return sum(n for key, n in self.counts.items() if key.endswith(f":{outcome}"))


class Soak:
    """The server, the API and the references; `run_client` is one client thread's loop."""

    def __init__(self, server, api, entries: dict[str, str], lora_model: str):
        self.server, self.api, self.entries, self.lora_model = server, api, entries, lora_model
        self.references: dict[tuple[str, str, int], np.ndarray] = {}
        self.tally = Tally()

    # -- requests -----------------------------------------------------------------------------------------------
    def sets_of(self, model: str) -> list[str]:
        return list(LORA_SETS) if model == self.lora_model else ["base"]

    def triton(self, model: str, lora_set: str, seed: int, protocol: str, *, steps: int = STEPS,
               timeout_s: float = 120.0, loras: str | None = None) -> np.ndarray:
        from trt_diffusion.triton.client import ImageRequest, generate_images

        if loras is None and LORA_SETS[lora_set] is not None:
            loras = json.dumps(LORA_SETS[lora_set])
        request = ImageRequest(PROMPT, SIZE, SIZE, steps=steps, seed=seed, loras=loras)
        url = self.server.grpc_url if protocol == "grpc" else self.server.http_url
        images, _ = generate_images(url, request, pipeline=self.entries[model], protocol=protocol, timeout_s=timeout_s)
        return images[0]

    def openai(self, model: str, lora_set: str, seed: int, *, timeout_s: float = 120.0, **extra) -> np.ndarray:
        from PIL import Image

        size = extra.pop("size", f"{SIZE}x{SIZE}")
        body = {"seed": seed, "num_inference_steps": extra.pop("steps", STEPS), **extra}
        if LORA_SETS[lora_set] is not None:
            body["loras"] = LORA_SETS[lora_set]
        result = self.client(timeout_s).images.generate(model=self.entries.get(model, model), prompt=PROMPT,
                                                        size=size, response_format="b64_json", extra_body=body)
        with Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))) as image:
            return np.asarray(image.convert("RGB"))

    def client(self, timeout_s: float):
        import openai

        return openai.OpenAI(base_url=self.api.url, api_key="soak", max_retries=0, timeout=timeout_s)

    def warm_up(self) -> None:
        """Every reference image, over gRPC; each LoRA set is applied once in the instances here."""
        for model in self.entries:
            for lora_set in self.sets_of(model):
                for seed in SEEDS:
                    self.references[(model, lora_set, seed)] = self.triton(model, lora_set, seed, "grpc")
        base = self.references[(self.lora_model, "base", 0)]
        for lora_set in LORA_SETS:  # a LoRA that changes nothing would make every LoRA check pass
            if lora_set != "base" and np.array_equal(self.references[(self.lora_model, lora_set, 0)], base):
                raise SystemExit(f"the LoRA set {lora_set!r} leaves the image unchanged: the soak could not tell")

    def good(self, rng: random.Random) -> None:
        protocol = rng.choice(("grpc", "http", "openai"))
        model = rng.choice(list(self.entries))
        lora_set, seed = rng.choice(self.sets_of(model)), rng.choice(SEEDS)
        kind = f"good-{protocol}"
        try:
            image = (self.openai(model, lora_set, seed) if protocol == "openai"
                     else self.triton(model, lora_set, seed, protocol))
        except Exception as exc:  # noqa: BLE001 - every failure of a good request is counted, never raised
            self.tally.add(kind, "failed", f"{model} {lora_set} seed {seed}: {type(exc).__name__}: {exc}")
            return
        if np.array_equal(image, self.references[(model, lora_set, seed)]):
            self.tally.add(kind, "ok")
        else:
            self.tally.add(kind, "failed", f"{model} {lora_set} seed {seed}: another image than the reference")

    def bad(self, rng: random.Random) -> None:
        """One bad request; refused with the expected words -> "refused", anything else -> "failed"."""
        import openai

        from trt_diffusion.errors import ServeError

        cases = {
            "unknown-lora": (lambda: self.triton(self.lora_model, "base", 0, "grpc",
                                                 loras='[{"name": "nope", "scale": 1}]'), ServeError, "nope"),
            "malformed-loras": (lambda: self.triton(self.lora_model, "base", 0, "http", loras="[{"),
                                ServeError, "LORAS"),
            "openai-size": (lambda: self.openai(self.lora_model, "base", 0, size="320x320"),
                            openai.BadRequestError, "size"),
            "openai-field": (lambda: self.openai(self.lora_model, "base", 0, sampler="euler"),
                             openai.BadRequestError, "sampler"),
            "openai-model": (lambda: self.openai("no-such-model", "base", 0), openai.APIStatusError, "no-such-model"),
        }
        name = rng.choice(sorted(cases))
        call, expected, words = cases[name]
        try:
            call()
        except expected as exc:
            if words in str(exc):
                self.tally.add(f"bad-{name}", "refused")
            else:
                self.tally.add(f"bad-{name}", "failed", f"refused without naming {words!r}: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - refused, but not as the API promises
            self.tally.add(f"bad-{name}", "failed", f"{type(exc).__name__}: {exc}")
            return
        self.tally.add(f"bad-{name}", "failed", "served")

    def cancel(self, rng: random.Random) -> None:
        """A long request the client gives up on after CANCEL_AFTER_S: it must end then, not when the work does."""
        protocol = rng.choice(("grpc", "openai"))
        model = rng.choice(list(self.entries))
        start = time.monotonic()
        try:
            if protocol == "openai":
                self.openai(model, "base", 0, steps=LONG_STEPS, timeout_s=CANCEL_AFTER_S)
            else:
                self.triton(model, "base", 0, "grpc", steps=LONG_STEPS, timeout_s=CANCEL_AFTER_S)
        except Exception:  # noqa: BLE001 - the deadline is the expected end, whatever type the client raises for it
            elapsed = time.monotonic() - start
            outcome = "cancelled" if elapsed < HANG_GUARD_S else "failed"
            self.tally.add(f"cancel-{protocol}", outcome, f"ended after {elapsed:.1f} s")
            return
        self.tally.add(f"cancel-{protocol}", "finished")  # the work outran the deadline: not a failure

    def run_client(self, index: int, end: float) -> None:
        rng = random.Random(1000 + index)
        actions = [self.good] * 14 + [self.bad] * 4 + [self.cancel] * 2
        while time.monotonic() < end:
            rng.choice(actions)(rng)


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, its anonymous part) of a process and its descendants. The anonymous part (RSS minus file-backed and
    shared pages) is what a leak grows; file-backed pages (mapped engines, libraries) come and go as the kernel
    reclaims them under another process's pressure."""
    import psutil

    root = psutil.Process(pid)
    rss = anonymous = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            info = process.memory_info()
        except psutil.Error:  # a stub that ended between the listing and the read
            continue
        rss += info.rss
        anonymous += info.rss - info.shared
    return rss, anonymous


def drift(samples: list[tuple[float, int]], window_s: float = 60.0) -> dict:
    """Memory at the start (median of the first window) and the end (median of the last), and their difference."""
    first_t, last_t = samples[0][0], samples[-1][0]
    start = [value for t, value in samples if t - first_t <= window_s]
    end = [value for t, value in samples if last_t - t <= window_s]
    mb = 1 << 20
    return {"start_mb": statistics.median(start) / mb, "end_mb": statistics.median(end) / mb,
            "drift_mb": (statistics.median(end) - statistics.median(start)) / mb,
            "max_mb": max(value for _, value in samples) / mb, "samples": len(samples)}


def soak(workdir: Path, minutes: float, clients: int, max_drift_mb: float, settle_minutes: float = 1.0) -> dict:
    from trt_diffusion import api
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.openai_api.server import ApiServer
    from trt_diffusion.openai_api.settings import ApiSettings
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.repository import PackageOptions

    config = prepare(workdir)
    models = list(load_engines_file(config).models)
    options = PackageOptions(pipeline_instances=2, batch_requests=2, lora_cache_sets=len(LORA_SETS) - 1,
                             max_queue_size=16, ensemble=False, stream=False)
    repo = workdir / "repo"
    api.package(config, repo, "onnxruntime", model=models, options=options)
    server, _ = stage.start(repo, work_dir=workdir / "work", first_request=False)
    api_server = None
    try:
        api_server = ApiServer(ApiSettings(server.grpc_url, port=0)).start()
        entries = {m.id: m.id for m in
                   __import__("openai").OpenAI(base_url=api_server.url, api_key="soak").models.list().data}
        if set(entries) != set(models):
            raise SystemExit(f"the server lists {sorted(entries)}, engines.yaml has {models}")
        run = Soak(server, api_server, entries, lora_model="sd15-tiny")
        run.warm_up()
        begin = time.monotonic()
        samples: list[tuple[float, tuple[int, int]]] = [(begin, tree_memory(server.process.pid))]
        end = begin + (settle_minutes + minutes) * 60
        threads = [threading.Thread(target=run.run_client, args=(i, end), daemon=True) for i in range(clients)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            time.sleep(SAMPLE_EVERY_S)
            samples.append((time.monotonic(), tree_memory(server.process.pid)))
            done = sum(run.tally.counts.values())
            print(f"soak: {(samples[-1][0] - begin) / 60:.1f} min, {done} requests, "
                  f"{run.tally.total('failed')} failed, server {samples[-1][1][0] / (1 << 20):.0f} MB "
                  f"({samples[-1][1][1] / (1 << 20):.0f} MB anonymous)", file=sys.stderr)
        healthy = np.array_equal(run.triton("sd15-tiny", "style", 0, "grpc"), run.references[("sd15-tiny", "style", 0)])
    finally:
        if api_server is not None:
            api_server.stop()
        server.stop()
    measured = [(t, value) for t, value in samples if t - begin >= settle_minutes * 60]
    rss = drift([(t, value[0]) for t, value in measured])
    anonymous = drift([(t, value[1]) for t, value in measured])
    result = {"minutes": minutes, "settle_minutes": settle_minutes, "clients": clients, "counts": dict(sorted(run.tally.counts.items())),
              "good_ok": run.tally.total("ok"), "bad_refused": run.tally.total("refused"),
              "cancelled": run.tally.total("cancelled"), "failed": run.tally.total("failed"),
              "failures": run.tally.failures, "healthy_after": healthy, "server_rss": rss,
              "server_anonymous": anonymous,
              "max_drift_mb": max_drift_mb}
    result["passed"] = (result["failed"] == 0 and healthy and result["good_ok"] > 0 and result["bad_refused"] > 0
                        and anonymous["drift_mb"] <= max_drift_mb)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--settle-minutes", type=float, default=1.0, help="load before the memory baseline")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("build/soak"))
    parser.add_argument("--max-drift-mb", type=float, default=DEFAULT_MAX_DRIFT_MB)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = soak(args.workdir, args.minutes, args.clients, args.max_drift_mb, args.settle_minutes)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
