"""3. Peak memory: the largest bucket with the most plugins (ControlNet; the served engines carry the repository's
LoRA variant) and the VAE decode, under the configured concurrency; fails over the budget."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ...sample_inputs import control_image
from ..deployment import MemorySampler
from .base import Check, CheckContext, Outcome, not_applicable

GB = 1024 ** 3


def run(ctx: CheckContext) -> Outcome:
    settings = ctx.settings.memory
    deployment = ctx.deployment
    before = deployment.memory()
    if before is None:
        return not_applicable(deployment.memory_unavailable_reason())
    bucket = max(deployment.buckets, key=lambda b: b.largest.width * b.largest.height)
    size = bucket.largest
    controlnet = deployment.controlnets[0] if deployment.controlnets else None
    concurrency = settings.concurrency or deployment.instances or 1
    requests = [ctx.request(size, steps=settings.steps, seed=i, controlnet=controlnet,
                            control_image=control_image(size.height, size.width, i) if controlnet else None)
                for i in range(max(settings.requests, concurrency))]
    with MemorySampler(deployment.memory) as sampler, ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(ctx.generate, requests))
    loras = sorted(ctx.resolved_model.loras)
    outcome = Outcome(summary="", thresholds={"max_rss_gb": settings.max_rss_gb, "max_gpu_gb": settings.max_gpu_gb})
    peak_cpu = (sampler.peak_cpu or 0) / GB if sampler.peak_cpu is not None else None
    peak_gpu = sampler.peak_gpu / GB if sampler.peak_gpu is not None else None
    outcome.figures = {
        "source": sampler.source or before.source, "size": str(size), "controlnet": controlnet,
        "concurrency": concurrency, "requests": len(requests),
        "cpu_before_gb": None if before.cpu_bytes is None else before.cpu_bytes / GB, "cpu_peak_gb": peak_cpu,
        "gpu_peak_gb": peak_gpu,
    }
    if loras:
        outcome.notes.append(f"LoRAs ({', '.join(loras)}): the served engines are the repository's one LoRA "
                             "variant; refit LoRAs change weights, not memory")
    if peak_cpu is not None and peak_cpu > settings.max_rss_gb:
        outcome.failures.append(f"peak CPU memory {peak_cpu:.2f} GB > budget {settings.max_rss_gb:g} GB "
                                f"({outcome.figures['source']})")
    if peak_gpu is None:
        outcome.notes.append("GPU memory: not reported here")
    elif settings.max_gpu_gb is not None and peak_gpu > settings.max_gpu_gb:
        outcome.failures.append(f"peak GPU memory {peak_gpu:.2f} GB > budget {settings.max_gpu_gb:g} GB")
    gpu = "" if peak_gpu is None else f", GPU {peak_gpu:.2f} GB"
    outcome.summary = (f"peak CPU {peak_cpu:.2f} GB (budget {settings.max_rss_gb:g} GB){gpu} at {size}"
                       f"{' + ControlNet ' + controlnet if controlnet else ''}, {concurrency} at once")
    return outcome


CHECK = Check("memory", "Peak memory", run)
