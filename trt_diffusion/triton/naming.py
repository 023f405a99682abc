"""Triton model names: readable, unique per engine, and safe as folder names."""

from __future__ import annotations

import re

from ..engines_file.engine_spec import EngineSpec

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def sanitize(text: str) -> str:
    """Keep [A-Za-z0-9_-]; anything else (dots, '..' of range buckets, spaces) becomes '-'."""
    cleaned = _UNSAFE.sub("-", text).strip("-")
    if not cleaned:
        raise ValueError(f"{text!r} has no character usable in a Triton model name")
    return cleaned


def engine_model_name(pipeline: str, spec: EngineSpec) -> str:
    """<pipeline>__<component>[__<controlnet>]__<bucket>__b<batch>; text encoders have bucket 'any'. A
    multi-profile engine (engine_layout: profiles) serves several: <pipeline>__<component>[__<controlnet>]__<n>profiles."""
    parts = [pipeline, spec.label]  # a step cache's piece (unet_deep, ...) is a model of its own
    if spec.controlnet:
        parts.append(spec.controlnet)
    if spec.profiles:
        parts.append(f"{len(spec.profiles)}profiles")
    else:
        parts.append(spec.bucket.label.replace("..", "-") if spec.bucket else "any")
        parts.append(f"b{spec.batch}")
    return "__".join(sanitize(p) for p in parts)


def entry_name(pipeline: str) -> str:
    return sanitize(pipeline)


def stage_name(pipeline: str, stage: str) -> str:
    return f"{sanitize(pipeline)}_{stage}"


def ensemble_name(pipeline: str) -> str:
    return f"{sanitize(pipeline)}_ensemble"
