"""Shards for tests that need two hosts to each build something.

An engine's shard is a hash of its key, and the key hashes the model's path — a temporary folder here — so
with four engines `--shard 1/2` holds none of them one run in eight. `two_host_shards` picks the smallest
N for which shard 1 and the other shards both hold engines: host A builds 1/N, host B builds 2/N … N/N.
"""

from __future__ import annotations

from pathlib import Path

from trt_diffusion import api
from trt_diffusion.engine_builds.report import BuildReport
from trt_diffusion.engine_builds.shards import shard_of
from trt_diffusion.engines_file import expand, load_engines_file


def two_host_shards(config_path: Path) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    keys = [spec.key for spec in expand(load_engines_file(config_path))]
    for count in range(2, 2 + 8 * len(keys)):
        shards = [shard_of(key, count) for key in keys]
        if 1 in shards and any(shard != 1 for shard in shards):
            return [(1, count)], [(index, count) for index in range(2, count + 1)]
    raise AssertionError(f"no shard count splits {len(keys)} engines in two")  # needs two engines at least


def build_shards(config_path: Path, shards: list[tuple[int, int]]) -> BuildReport:
    """One host building several shards, one `build --shard` after another, as one report."""
    reports = [api.build(config_path, shard=shard) for shard in shards]
    return BuildReport(outcomes=[o for r in reports for o in r.outcomes],
                       skipped_targets={k: v for r in reports for k, v in r.skipped_targets.items()})
