"""The engine matrix: the seed's worked example, stable keys, and which keys each field changes."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trt_diffusion import api
from trt_diffusion.cli import main
from trt_diffusion.engines_file import expand, load_engines_file


def seed_example(model_dir: Path) -> dict:
    """The seed's exercise: an online service with 512², 768² and 1024² buckets on TensorRT, CFG batch 2
    kept apart from batch 1, one ControlNet and two LoRAs."""
    return {
        "version": 1,
        "defaults": {"targets": ["tensorrt"]},
        "models": {
            "sd15": {
                "source": str(model_dir),
                "family": "sd15",
                "buckets": ["512x512", "768x768", "1024x1024"],
                "batch": [1],
                "cfg": ["batched", "split"],  # batch-2 engine for one-call CFG, batch-1 engine for two calls
                "controlnets": {"canny": {"source": str(model_dir / "controlnet")}},
                "loras": {
                    "a": {"source": str(model_dir / "lora/pytorch_lora_weights.safetensors"), "mode": "refit"},
                    "b": {"source": str(model_dir / "lora/pytorch_lora_weights.safetensors"), "mode": "refit"},
                },
            }
        },
    }


def write_config(tmp_path: Path, data: dict, name: str = "engines.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def keys_of(path: Path) -> dict[tuple, str]:
    specs = expand(load_engines_file(path))
    return {(s.target, s.name): s.key for s in specs}


def test_seed_example_counts(tmp_path, tiny_sd15_dir):
    plan = api.plan(write_config(tmp_path, seed_example(tiny_sd15_dir)))
    # 3 buckets × 2 denoiser batches (CFG batched = 2, split = 1) = 6 UNet engines.
    assert plan.count("sd15", "unet") == 6
    # The ControlNet is its own network, run next to the UNet at the UNet's batch: one engine per bucket
    # and batch shape, so the CFG split doubles it too.
    assert plan.count("sd15", "controlnet") == 6
    # Text encoders depend on neither resolution nor CFG (prompt and negative are encoded in separate
    # calls); the VAE does not depend on CFG.
    assert plan.count("sd15", "text_encoder") == 1
    assert plan.count("sd15", "vae_decoder") == 3
    # Refit LoRAs add no engines: they make the UNet engines refittable instead.
    assert all(s.refittable for s in plan.specs if s.component == "unet")
    assert plan.total_engines == 16
    unet_row = next(r for r in plan.rows if r.component == "unet")
    assert unet_row.formula == "3 buckets (512x512, 768x768, 1024x1024) × 2 batch shapes (1, 2)"


def test_fused_loras_multiply_denoiser_engines(tmp_path, tiny_sd15_dir):
    data = seed_example(tiny_sd15_dir)
    for lora in data["models"]["sd15"]["loras"].values():
        lora["mode"] = "fused"
    plan = api.plan(write_config(tmp_path, data))
    assert plan.count("sd15", "unet") == 18  # base + 2 fused variants, each 6
    assert plan.count("sd15", "controlnet") == 6  # a LoRA changes the UNet, not the ControlNet
    assert not any(s.refittable for s in plan.specs)


def test_plan_json_and_table(tmp_path, tiny_sd15_dir, capsys):
    path = write_config(tmp_path, seed_example(tiny_sd15_dir))
    assert main(["plan", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total_engines"] == 16
    assert len({e["key"] for e in data["engines"]}) == 16
    unet = [r for r in data["rows"] if r["component"] == "unet"][0]
    assert unet["engines"] == 6 and unet["parameters"] > 0
    assert unet["disk_bytes"] == 6 * unet["parameters"] * 2  # fp16 by default
    assert main(["plan", str(path)]) == 0
    assert "16 engines" in capsys.readouterr().out


def test_keys_are_the_same_in_two_processes(tmp_path, tiny_sd15_dir):
    path = write_config(tmp_path, seed_example(tiny_sd15_dir))
    runs = [
        subprocess.run([sys.executable, "-m", "trt_diffusion", "plan", str(path), "--json"],
                       capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": str(seed), "PATH": ""})
        for seed in (1, 2)
    ]
    keys = [[e["key"] for e in json.loads(r.stdout)["engines"]] for r in runs]
    assert keys[0] == keys[1] and len(keys[0]) == 16


def base_config(model_dir: Path) -> dict:
    return {
        "version": 1,
        "build": {"opset": 20, "jobs": 1, "tensorrt": {"optimization_level": 3}},
        "defaults": {"targets": ["tensorrt", "onnxruntime"]},
        "models": {
            "m": {
                "source": str(model_dir), "family": "sd15",
                "components": ["text_encoder", "unet", "vae_decoder"],
                "buckets": ["512x512", "768x768"], "batch": [1], "cfg": ["batched"],
                "precision": {"text_encoder": "fp16", "unet": "fp16", "vae_decoder": "fp32", "controlnet": "fp16"},
                "controlnets": {"canny": {"source": str(model_dir / "controlnet")}},
                "loras": {
                    "style": {"source": str(model_dir / "lora/pytorch_lora_weights.safetensors"), "mode": "refit"},
                    "fusedstyle": {"source": str(model_dir / "lora/pytorch_lora_weights.safetensors"),
                                   "mode": "fused", "scale": 0.5},
                },
            }
        },
    }


def _set(data: dict, dotted: str, value) -> dict:
    data = copy.deepcopy(data)
    node = data
    *parents, last = dotted.split(".")
    for p in parents:
        node = node[p]
    node[last] = value
    return data


def _component(name: str) -> str:
    return name.split(".")[1]


# (field, new value, predicate on (target, engine name) selecting exactly the keys that must change)
CHANGES = [
    ("models.m.precision.unet", "fp32", lambda t, n: _component(n) == "unet"),
    ("models.m.precision.vae_decoder", "fp16", lambda t, n: _component(n) == "vae_decoder"),
    ("build.tensorrt.optimization_level", 5, lambda t, n: t == "tensorrt"),
    ("build.opset", 21, lambda t, n: True),
    ("models.m.controlnets.canny.source", "CN2", lambda t, n: _component(n) == "controlnet"),
    ("models.m.loras.fusedstyle.scale", 0.7, lambda t, n: "lora-fusedstyle" in n),
    ("models.m.loras.style.scale", 0.3, lambda t, n: False),  # refit LoRAs are applied at run time
    ("build.jobs", 2, lambda t, n: False),  # how we build, not what
    ("models.m.cfg", ["split"], lambda t, n: _component(n) in ("unet", "controlnet")),
    ("models.m.source", "OTHER", lambda t, n: _component(n) != "controlnet"),
]


@pytest.mark.parametrize("field,value,selects", CHANGES, ids=[c[0] for c in CHANGES])
def test_each_field_changes_exactly_its_keys(tmp_path, tiny_sd15_dir, field, value, selects):
    base = base_config(tiny_sd15_dir)
    if value == "CN2":  # another ControlNet folder with the same contents
        other = tmp_path / "cn2"
        other.symlink_to(tiny_sd15_dir / "controlnet")
        value = str(other)
    if value == "OTHER":
        other = tmp_path / "other-model"
        other.symlink_to(tiny_sd15_dir)
        value = str(other)
    before = keys_of(write_config(tmp_path, base, "a.yaml"))
    after = keys_of(write_config(tmp_path, _set(base, field, value), "b.yaml"))
    shared = before.keys() & after.keys()
    changed = {k for k in shared if before[k] != after[k]} | (before.keys() ^ after.keys())
    expected = {k for k in before.keys() | after.keys() if selects(*k)}
    assert changed == expected


def test_adding_a_bucket_keeps_existing_keys(tmp_path, tiny_sd15_dir):
    base = base_config(tiny_sd15_dir)
    before = keys_of(write_config(tmp_path, base, "a.yaml"))
    after = keys_of(write_config(tmp_path, _set(base, "models.m.buckets", ["512x512", "768x768", "1024x1024"]), "b.yaml"))
    assert all(after[k] == v for k, v in before.items())
    added = after.keys() - before.keys()
    assert added and all("1024x1024" in name for _, name in added)
    assert not any(_component(n) == "text_encoder" for _, n in added)
