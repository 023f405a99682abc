"""2. Every bucket compiled and warm: each resolution bucket engines.yaml declares has its engines built and
served, and its first request after start is timed against a threshold (a deployment check: the latency the
first user of that size sees)."""

from __future__ import annotations

import time

from .base import Check, CheckContext, Outcome, seconds_text


def run(ctx: CheckContext) -> Outcome:
    settings = ctx.settings.buckets
    model = ctx.resolved_model
    served = {b.label: b for b in ctx.deployment.buckets}
    missing_by_bucket: dict[str, list[str]] = {}
    for spec in ctx.engines.missing:
        for bucket in spec.buckets:  # a multi-profile engine (engine_layout: profiles) serves several
            if bucket is not None:
                missing_by_bucket.setdefault(bucket.label, []).append(spec.name)
    outcome = Outcome(summary="", thresholds={"max_first_request_s": settings.max_first_request_s})
    worst = None
    for bucket in model.buckets:
        label = bucket.label
        row = {"bucket": label, "engines_built": label not in missing_by_bucket, "served": label in served,
               "first_request_s": None, "timed_at": None}
        if label in missing_by_bucket:
            names = missing_by_bucket[label]
            outcome.failures.append(f"bucket {label}: {len(names)} engine(s) not built ({', '.join(names[:3])}"
                                    f"{', …' if len(names) > 3 else ''}): its first request would fail or "
                                    "compile on the spot")
        if label not in served:
            if label not in missing_by_bucket:
                outcome.failures.append(f"bucket {label}: declared in engines.yaml but not served by "
                                        f"{ctx.deployment.url or 'the deployment'}")
            outcome.rows.append(row)
            continue
        seconds = ctx.deployment.first_requests.get(label)
        row["timed_at"] = "start (before any other request)" if seconds is not None else "first request of preflight"
        if seconds is None:
            request = ctx.request(served[label].request, steps=settings.steps)
            start = time.perf_counter()
            try:
                ctx.generate(request)
            except Exception as err:  # noqa: BLE001 - a failing first request is this check's finding
                outcome.failures.append(f"bucket {label}: the first request failed: {err}")
                outcome.rows.append(row)
                continue
            seconds = time.perf_counter() - start
        row["first_request_s"] = seconds
        worst = seconds if worst is None else max(worst, seconds)
        if seconds > settings.max_first_request_s:
            outcome.failures.append(f"bucket {label}: first request took {seconds:.2f} s "
                                    f"(> {settings.max_first_request_s:g} s): not warm")
        outcome.rows.append(row)
    outcome.figures = {"buckets_declared": len(model.buckets), "buckets_served": sum(r["served"] for r in outcome.rows),
                       "buckets_built": sum(r["engines_built"] for r in outcome.rows),
                       "worst_first_request_s": worst, "steps": settings.steps}
    if not ctx.deployment.started_by_preflight and ctx.deployment.kind == "served":
        outcome.notes.append("the server was started elsewhere: these are preflight's first requests, not the "
                             "server's (`trt-diffusion serve` records those in warmup_report.json)")
    outcome.summary = (f"{outcome.figures['buckets_served']}/{len(model.buckets)} buckets built and served; worst "
                       f"first request {seconds_text(worst)} (max {settings.max_first_request_s:g} s)")
    return outcome


CHECK = Check("buckets", "Every bucket compiled and warm", run)
