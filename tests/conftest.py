"""Shared fixtures: tiny seeded model folders, written once per session through the real code path,
and engines.yaml files that point at them."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from trt_diffusion.models.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """`tiny_model_factory(family, controlnet=False, lora=False, variant=None) -> Path`, cached per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[tuple, Path] = {}

    def make(family: str, controlnet: bool = False, lora: bool = False, variant: str | None = None) -> Path:
        key = (family, controlnet, lora, variant)
        if key not in cache:
            name = f"{family}{'-cn' if controlnet else ''}{'-lora' if lora else ''}{f'-{variant}' if variant else ''}"
            cache[key] = write_tiny_model(root / name, family, controlnet=controlnet, lora=lora, variant=variant)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory):
    """`tiny_model_dir(family, controlnet=False, lora=False) -> Path`: the same cached factory, by its usual name."""
    return tiny_model_factory


@pytest.fixture(scope="session")
def tiny_sd15_dir(tiny_model_factory) -> Path:
    """An sd15 tiny model with a ControlNet (in controlnet/) and a LoRA (in lora/)."""
    return tiny_model_factory("sd15", controlnet=True, lora=True)


@pytest.fixture(scope="session")
def write_engines_yaml():
    """`write_engines_yaml(directory, model_dir, family, name=None, workspace="build", **model_fields) -> Path`.

    Writes `<directory>/engines.yaml` with one model (named `<family>-tiny` unless given) built from
    `model_dir`, targeting onnxruntime at batch 1 and 64x64 unless `model_fields` say otherwise
    (components, buckets, precision, controlnets, loras, batch, cfg, targets...).
    """

    def write(directory: Path, model_dir: Path, family: str, name: str | None = None, workspace: str = "build",
              **model_fields: Any) -> Path:
        model = {"source": str(model_dir), "family": family, "buckets": ["64x64"], "batch": [1],
                 "targets": ["onnxruntime"], **model_fields}
        document = {"version": 1, "build": {"workspace": workspace}, "models": {name or f"{family}-tiny": model}}
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "engines.yaml"
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path

    return write


@pytest.fixture(scope="session")
def built_sd15(tmp_path_factory, tiny_sd15_dir, write_engines_yaml) -> Path:
    """engines.yaml of the tiny sd15 model (64x64, CFG batched, a ControlNet, a refit LoRA) with every
    onnxruntime engine built. Shared by the build, parity and Triton tests; treat it as read-only."""
    from trt_diffusion import api

    config = write_engines_yaml(
        tmp_path_factory.mktemp("built-sd15"), tiny_sd15_dir, "sd15",
        precision={"text_encoder": "fp32", "unet": "fp32", "vae_decoder": "fp32"},
        controlnets={"canny": {"source": str(tiny_sd15_dir / "controlnet")}},
        loras={"style": {"source": str(tiny_sd15_dir / "lora/pytorch_lora_weights.safetensors"), "mode": "refit"}},
    )
    report = api.build(config, target="onnxruntime")
    if report.failed:
        raise RuntimeError(f"fixture build failed: {[o.error for o in report.failed]}")
    return config


@dataclass(frozen=True)
class SealedRelease:
    config: Path  # engines.yaml of a copy of `built_sd15`'s workspace, its engine release signed
    private_key: Path
    public_key: Path
    repo: Path  # packaged with --verify and sealed with --sign: treat it as read-only, copy it to tamper


@pytest.fixture(scope="session")
def sealed_sd15(tmp_path_factory, built_sd15) -> SealedRelease:
    """The tiny sd15 release as a release host makes it: `manifest --sign`, then `package --verify --sign`."""
    from signed_release import signed_workspace_copy

    from trt_diffusion.triton import stage

    root = tmp_path_factory.mktemp("sealed")
    config, private, public = signed_workspace_copy(built_sd15, root)
    stage.package_stage(config, root / "sealed-repo", verify_keys=[public], sign_key=private)
    return SealedRelease(config, private, public, root / "sealed-repo")


@pytest.fixture(scope="session")
def built_sd15_step_cache(tmp_path_factory, tiny_model_factory, write_engines_yaml) -> Path:
    """engines.yaml of the tiny sd15 with DeepCache (interval 3, branch 0), batch 1 and 2 (CFG batched), every
    onnxruntime engine built (unet, unet_deep, unet_shallow...). Shared by the step-cache runtime, parity and
    Triton tests; treat it as read-only."""
    from trt_diffusion import api

    config = write_engines_yaml(tmp_path_factory.mktemp("built-step-cache"), tiny_model_factory("sd15"), "sd15",
                                precision={"text_encoder": "fp32", "unet": "fp32", "vae_decoder": "fp32"},
                                batch=[1, 2], step_cache={"method": "deepcache", "interval": 3, "branch": 0})
    report = api.build(config, target="onnxruntime")
    if report.failed:
        raise RuntimeError(f"fixture build failed: {[o.error for o in report.failed]}")
    return config


@pytest.fixture(scope="session")
def built_sd15_workflows(tmp_path_factory, tiny_sd15_dir, write_engines_yaml) -> Path:
    """engines.yaml of the tiny sd15 model declaring txt2img, img2img and inpaint (so a VAE encoder engine too),
    fp32, a refit LoRA, with every onnxruntime and openvino engine built. Shared by the workflow parity, preflight
    and Triton tests; treat it as read-only."""
    from trt_diffusion import api

    config = write_engines_yaml(
        tmp_path_factory.mktemp("built-sd15-workflows"), tiny_sd15_dir, "sd15",
        workflows=["txt2img", "img2img", "inpaint"], targets=["onnxruntime", "openvino"],
        precision={"text_encoder": "fp32", "unet": "fp32", "vae_decoder": "fp32"},
        loras={"style": {"source": str(tiny_sd15_dir / "lora/pytorch_lora_weights.safetensors"), "mode": "refit"}},
    )
    report = api.build(config)
    if report.failed:
        raise RuntimeError(f"fixture build failed: {[o.error for o in report.failed]}")
    return config


QWEN_COMPONENTS = ["text_encoder", "transformer", "vae_decoder", "vae_encoder"]


@pytest.fixture(scope="session")
def built_qwen_image(family_workspace) -> Path:
    """engines.yaml of the tiny Qwen-Image (model `qwen_image`: 64x64, batch 1, `cfg: [split]`, fp32, its four
    components) exported and built on onnxruntime and openvino, once per session, over `family_workspace` (the
    minimal entry's text encoder, transformer and VAE decoder are shared with the conformance run, the VAE encoder is
    added): the export, reference and quantize tests share it. Read-only, like `built_sd15` (a test that changes the
    model writes its own engines.yaml beside it, over the same workspace)."""
    from family_builds import families_engines_yaml

    from trt_diffusion import api

    directory = family_workspace.root / "qwen_image-four-components"
    directory.mkdir(exist_ok=True)
    config = families_engines_yaml(family_workspace, directory / "engines.yaml", ("qwen_image",),
                                   components=QWEN_COMPONENTS, cfg=["split"], targets=["onnxruntime", "openvino"],
                                   precision={c: "fp32" for c in QWEN_COMPONENTS})
    report = api.build(config)
    if report.failed:
        raise RuntimeError(f"fixture build failed: {[o.error for o in report.failed]}")
    return config


@pytest.fixture(scope="session")
def built_wan(family_workspace):
    """`built_wan(cfg="split") -> engines.yaml`: the tiny Wan 2.1 at its minimal bucket (32x32x5: plan_keys.py's
    BUCKETS), batch 1, CFG `cfg`, its default precisions, onnxruntime engines built, over `family_workspace` (the
    minimal entry's exports and its text encoder and VAE engines are shared with the conformance run). `split` and
    `parallel` differ in how the runtime calls the transformer, not in its engines, so only the first mode builds.
    Read-only, like `built_sd15` (the video preflight test keeps its baseline under the workspace's preflight/)."""
    from family_builds import families_engines_yaml

    from trt_diffusion import api

    built: dict[str, Path] = {}

    def build(cfg: str = "split") -> Path:
        if cfg not in built:
            directory = family_workspace.root / f"wan-{cfg}"
            directory.mkdir(exist_ok=True)
            path = families_engines_yaml(family_workspace, directory / "engines.yaml", ("wan",), batch=[1],
                                         targets=["onnxruntime"], cfg=[cfg])
            report = api.build(path, target="onnxruntime")
            if report.failed:
                raise RuntimeError(f"fixture build failed: {[o.error for o in report.failed]}")
            built[cfg] = path
        return built[cfg]

    return build


# built_wan_i2v's bucket per variant (width x height x frames): Wan 2.2's is not square, so a first frame read
# with its sides swapped cannot pass
WAN_I2V_BUCKETS = {"i2v": "32x32x5", "i2v_two_expert": "48x32x5"}
WAN_I2V_FP32 = {"text_encoder": "fp32", "image_encoder": "fp32", "transformer": "fp32", "transformer_2": "fp32",
                "vae_encoder": "fp32", "vae_decoder": "fp32"}


@pytest.fixture(scope="session")
def built_wan_i2v(tiny_model_factory, tmp_path_factory):
    """`built_wan_i2v(variant="i2v", target="onnxruntime") -> engines.yaml`: a tiny Wan image-to-video checkpoint
    (`i2v`: Wan 2.1 I2V with its CLIP image encoder, at 32x32x5; `i2v_two_expert`: Wan 2.2 I2V A14B, at 48x32x5),
    batch 1, CFG split, fp32, serving img2vid. One workspace per variant listing onnxruntime and openvino; each
    target is built on first use (about a minute on 2 cores; the second reuses the exports). Read-only, like
    `built_sd15`."""
    from trt_diffusion import api

    workspaces: dict[str, Path] = {}
    built: set[tuple[str, str]] = set()

    def build(variant: str = "i2v", target: str = "onnxruntime") -> Path:
        if variant not in workspaces:
            root = tmp_path_factory.mktemp(f"built-wan-{variant}")
            model = {"source": str(tiny_model_factory("wan", variant=variant)), "family": "wan",
                     "buckets": [WAN_I2V_BUCKETS[variant]], "batch": [1], "cfg": ["split"], "workflows": ["img2vid"],
                     "targets": ["onnxruntime", "openvino"],
                     "precision": {c: p for c, p in WAN_I2V_FP32.items()  # the components the checkpoint has
                                   if c != {"i2v": "transformer_2", "i2v_two_expert": "image_encoder"}[variant]}}
            path = root / "engines.yaml"
            path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": str(root / "build")},
                                            "models": {"wan": model}}, sort_keys=False))
            workspaces[variant] = path
        if (variant, target) not in built:
            report = api.build(workspaces[variant], target=target)
            if report.failed:
                raise RuntimeError(f"fixture build failed: {[o.error for o in report.failed]}")
            built.add((variant, target))
        return workspaces[variant]

    return build


LORA_FOLDERS = ("z_image",)  # family_workspace's entries whose tiny folder has its LoRA (tests/z_image/conftest.py)


@pytest.fixture(scope="session")
def family_workspace(tiny_model_factory, tmp_path_factory):
    """(path, root): ONE engines.yaml with every declared family's minimal entry (source, family, one bucket:
    tests/families/plan_keys.py) and its workspace, nothing built. The family conformance run builds all of it
    (`built_families`); a file that needs one family's engines in another form (Qwen-Image's four components, Wan
    with CFG split, Z-Image's refit LoRA, FLUX.2 quantized) writes its own engines.yaml over the same workspace
    (tests/shared/family_builds.py): the exports and engines the forms share are built once, by whichever file
    asks first. tests/shared/slow_schedule.py keeps these files on one xdist worker. Treat it as read-only."""
    from types import SimpleNamespace

    from tests.families.plan_keys import all_families_engines_yaml

    root = tmp_path_factory.mktemp("family-conformance")
    # Z-Image's folder carries its tiny LoRA (models tiny --lora), so the LoRA-refit files build over these exports
    path = all_families_engines_yaml(root, lambda family: tiny_model_factory(family, lora=family in LORA_FOLDERS))
    return SimpleNamespace(path=path, root=root)


@pytest.fixture(scope="session")
def built_families(family_workspace):
    """`family_workspace` built on this host's default targets: (path, root, report, specs). What failed is the
    conformance run's finding (test_builds), not this fixture's."""
    from types import SimpleNamespace

    from trt_diffusion import api

    report = api.build(family_workspace.path)
    specs = api.plan(family_workspace.path, count_parameters=False).specs
    return SimpleNamespace(path=family_workspace.path, root=family_workspace.root, report=report, specs=specs)


# Helpers shared by several test folders (the target conformance suite) live in tests/shared/.
sys.path.insert(0, str(Path(__file__).parent / "shared"))


# What a worker process and the processes it starts (Triton servers, CLI runs) may use when xdist runs several
# workers: torch's OpenMP/MKL threads and the openvino runner's (TRT_DIFFUSION_OPENVINO_THREADS).
THREAD_SHARE_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TRT_DIFFUSION_OPENVINO_THREADS")


def pytest_configure(config):
    """Under xdist each worker gets its share of the cores. Two workers each running two OpenMP threads on CI's two
    cores cost CPU to oversubscription (two slow files run side by side: 230 -> 185 CPU-seconds, 141 -> 120 s wall
    with one thread each). A variable the caller set is kept."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    share = str(max(1, len(os.sched_getaffinity(0)) // int(workers)))
    for name in THREAD_SHARE_ENV:
        os.environ.setdefault(name, share)
    if "torch" in sys.modules:  # imported already: it read OMP_NUM_THREADS before this
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_xdist_make_scheduler(config, log):
    """`make test-slow` (--dist loadfile): files sharing a session build on one worker, the soak first
    (tests/shared/slow_schedule.py)."""
    if getattr(config.option, "dist", None) != "loadfile":
        return None
    from slow_schedule import make_scheduler

    return make_scheduler(config, log)


@pytest.fixture(scope="session")
def built_sd15_two_loras(built_sd15, tmp_path_factory) -> Path:
    """engines.yaml over `built_sd15`'s workspace (its engines, not rebuilt) serving two refit LoRAs: `style` (the
    tiny model's LoRA) and `detail` (the same layers, other seeded values at twice the size, so the two sets give
    clearly different images). For LoRA per request (issue 28)."""
    import torch
    from safetensors.torch import load_file, save_file

    document = yaml.safe_load(built_sd15.read_text())
    (name, model), = document["models"].items()
    style = Path(model["loras"]["style"]["source"])
    generator = torch.Generator().manual_seed(28)
    detail = {key: torch.randn(value.shape, generator=generator) * value.float().std() * 2
              for key, value in sorted(load_file(str(style)).items())}
    folder = tmp_path_factory.mktemp("sd15-two-loras")
    save_file(detail, str(folder / "detail.safetensors"))
    model["loras"]["detail"] = {"source": str(folder / "detail.safetensors"), "mode": "refit"}
    document["build"]["workspace"] = str((built_sd15.parent / document["build"]["workspace"]).resolve())
    path = folder / "engines.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path
