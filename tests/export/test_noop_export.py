"""A no-op `export` costs what a no-op `build` does (issue #47): answered from a stat record of the last complete
export (export/export_state.py), it hashes no file and imports no torch; any change falls back to the full check,
which hashes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file


@pytest.fixture
def hash_calls(monkeypatch) -> list[str]:
    """Every file the export path hashes (the one sha256 of workspace/files.py, wherever it is imported)."""
    from trt_diffusion.export import artifact_key
    from trt_diffusion.workspace import files, store

    calls: list[str] = []
    real = files.sha256_file

    def counting(path, *args, **kwargs):
        calls.append(str(path))
        return real(path, *args, **kwargs)

    for module in (files, store, artifact_key):
        monkeypatch.setattr(module, "sha256_file", counting)
    return calls


@pytest.fixture
def private_export(sd15_export, sd15_main_fields, tiny_model_dir, write_engines_yaml, tmp_path) -> Path:
    """A copy of the session's sd15 export (model and workspace): these tests touch its files."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("sd15", controlnet=True), model)
    shutil.copytree(load_engines_file(sd15_export.config).workspace, tmp_path / "build")
    return write_engines_yaml(tmp_path, model, "sd15", **sd15_main_fields(model))


def test_a_second_export_hashes_no_file(private_export, hash_calls):
    first = api.export(private_export)  # another engines.yaml: the full check (cached by content), which hashes
    assert all(r.cached for r in first.results) and hash_calls
    hash_calls.clear()

    second = api.export(private_export)
    assert hash_calls == []
    assert [(r.group.key, r.cached, r.onnx_path) for r in second.results] == \
        [(r.group.key, True, r.onnx_path) for r in first.results]
    assert second.results[0].max_rel_error == first.results[0].max_rel_error  # the artifact's manifest, read

    # what keeps it under a second: torch is not even imported
    code = ("import sys\nfrom trt_diffusion import api\n"
            f"report = api.export({str(private_export)!r})\n"
            "print('cached', all(r.cached for r in report.results), 'torch', 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cached True torch False" in result.stdout, result.stdout + result.stderr[-3000:]


def test_a_touched_weight_or_artifact_falls_back_to_the_full_check(private_export, hash_calls):
    api.export(private_export)
    weights = private_export.parent / "model" / "unet" / "diffusion_pytorch_model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    hash_calls.clear()
    report = api.export(private_export)
    assert str(weights) in hash_calls  # hashed again: the stat no longer vouches for it
    assert all(r.cached for r in report.results)  # same bytes: the full check reuses every artifact

    onnx = report.results[0].onnx_path
    os.utime(onnx, ns=(onnx.stat().st_atime_ns, onnx.stat().st_mtime_ns + 1_000_000))
    hash_calls.clear()
    api.export(private_export)
    assert str(onnx) in hash_calls  # the store verifies the artifact's bytes again


def _new_bytes_with_the_old_stat(weights: Path) -> None:
    """New weights of the same size, given the old file's mtime and renamed over it (what a copy that preserves
    timestamps does): only the inode differs."""
    from safetensors.torch import load_file, save_file

    old = weights.stat()
    tensors = load_file(weights)
    name = next(key for key, tensor in tensors.items() if tensor.is_floating_point())
    tensors[name] = tensors[name] + 0.01
    staged = weights.with_name("staged.safetensors.tmp")
    save_file(tensors, staged, metadata={"format": "pt"})
    os.utime(staged, ns=(old.st_atime_ns, old.st_mtime_ns))
    os.replace(staged, weights)
    new = weights.stat()
    assert (new.st_size, new.st_mtime_ns) == (old.st_size, old.st_mtime_ns) and new.st_ino != old.st_ino


def test_new_bytes_behind_the_same_size_and_mtime_are_not_vouched_for(private_export):
    from trt_diffusion.engines_file.selection import select_specs
    from trt_diffusion.export import export_state, group_specs

    api.export(private_export)  # the full check, then the record
    config = load_engines_file(private_export)
    groups = group_specs(select_specs(config, None, None))
    assert export_state.unchanged_report(config, groups) is not None  # the record vouches for what it saw
    _new_bytes_with_the_old_stat(private_export.parent / "model" / "text_encoder" / "model.safetensors")
    assert export_state.unchanged_report(config, groups) is None  # ... and not for new bytes


@pytest.mark.slow  # a text encoder export and its parity check (about 20 s on 2 loaded cores)
def test_new_bytes_behind_the_same_size_and_mtime_re_export(private_export, hash_calls):
    """... so the export hashes them and re-exports the component made from them, and only it."""
    first = api.export(private_export)
    weights = private_export.parent / "model" / "text_encoder" / "model.safetensors"
    _new_bytes_with_the_old_stat(weights)
    hash_calls.clear()

    report = api.export(private_export)
    assert str(weights) in hash_calls
    assert {r.group.component: r.cached for r in report.results} == {
        r.group.component: r.group.component != "text_encoder" for r in first.results}
