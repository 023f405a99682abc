"""CI matrices without a cluster: shards of the matrix built into one workspace equal one local build, a
plain build afterwards builds nothing, and the release manifest records and verifies every engine."""

from __future__ import annotations

import shutil

import pytest
import yaml
from shard_split import build_shards, two_host_shards

from trt_diffusion import api
from trt_diffusion.cli import main
from trt_diffusion.engine_builds.shards import parse_shard, shard_of, shard_specs
from trt_diffusion.engines_file import expand, load_engines_file
from trt_diffusion.errors import ConfigError
from trt_diffusion.workspace.files import sha256_file
from trt_diffusion.workspace.provenance import engine_files


def _digests(outcomes, root):
    """sha256 of every engine file but its manifest (which records when and how long the build took)."""
    return {o.spec.key: {str(f.relative_to(root)): sha256_file(f) for f in engine_files(o.path)
                         if "manifest" not in f.name} for o in outcomes}


@pytest.fixture
def fresh_workspace(tmp_path, built_sd15):
    data = yaml.safe_load(built_sd15.read_text())
    data["build"]["workspace"] = str(tmp_path / "build")
    shutil.copytree(built_sd15.parent / "build" / "onnx", tmp_path / "build" / "onnx")  # reuse verified exports
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shards_partition_the_matrix_deterministically(built_sd15):
    specs = expand(load_engines_file(built_sd15))
    parts = [shard_specs(specs, i, 3) for i in (1, 2, 3)]
    assert sorted(s.key for part in parts for s in part) == sorted(s.key for s in specs)
    assert all(shard_of(s.key, 3) == i for i, part in enumerate(parts, 1) for s in part)
    assert parse_shard("2/3") == (2, 3)
    for bad in ("0/2", "3/2", "x", "1/0"):
        with pytest.raises(ConfigError, match="--shard"):
            parse_shard(bad)


def test_two_shards_equal_one_local_build_and_the_final_build_is_a_no_op(fresh_workspace, built_sd15):
    first_shards, second_shards = two_host_shards(fresh_workspace)
    first = build_shards(fresh_workspace, first_shards)
    second = build_shards(fresh_workspace, second_shards)
    assert not first.failed and not second.failed
    assert first.outcomes and second.outcomes  # both shards hold engines of this matrix
    assert {o.spec.key for o in first.outcomes}.isdisjoint(o.spec.key for o in second.outcomes)
    final = api.build(fresh_workspace)
    assert not final.built and len(final.cached) == len(first.outcomes) + len(second.outcomes)

    local = api.build(built_sd15)
    local_root = load_engines_file(built_sd15).workspace
    shard_root = load_engines_file(fresh_workspace).workspace
    assert _digests(final.outcomes, shard_root) == _digests(local.outcomes, local_root)


def test_the_release_manifest_records_and_verifies_every_engine(fresh_workspace, capsys):
    api.build(fresh_workspace)
    assert main(["manifest", str(fresh_workspace)]) == 0
    result = api.manifest(fresh_workspace)
    assert result["counts"]["ok"] == 4 and result["counts"]["modified"] == 0
    entry = result["engines"][0]
    assert entry["built_by"]["host"] and entry["tools"]["onnxruntime"] and entry["files"]
    assert all(len(f["sha256"]) == 64 for f in entry["files"].values())

    workspace = load_engines_file(fresh_workspace).workspace
    tampered = workspace / next(iter(entry["files"]))
    with open(tampered, "ab") as handle:
        handle.write(b"\0")
    capsys.readouterr()
    assert main(["manifest", str(fresh_workspace)]) == 1
    assert "differ from what their build recorded" in capsys.readouterr().err
