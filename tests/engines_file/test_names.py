"""Model, ControlNet and LoRA names become file names: the schema refuses anything but a plain name, and no
artifact path leaves the workspace (issue 20, item 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trt_diffusion.cli import main
from trt_diffusion.engines_file.engine_spec import EngineSpec
from trt_diffusion.engines_file.load import load_engines_file
from trt_diffusion.errors import ConfigError
from trt_diffusion.workspace.store import ArtifactStore

ESCAPE = "../../../../../tmp/x/ESCAPED"


def _yaml(model_dir: Path, model="m", controlnet="canny", lora="style") -> str:
    return (f"version: 1\nmodels:\n  {model!r}:\n    source: {model_dir}\n    family: sd15\n"
            f"    buckets: ['64x64']\n    targets: [onnxruntime]\n"
            f"    controlnets:\n      {controlnet!r}: {{source: {model_dir}/controlnet}}\n"
            f"    loras:\n      {lora!r}: {{source: {model_dir}/lora/pytorch_lora_weights.safetensors}}\n")


@pytest.mark.parametrize("field,line", [("model", 3), ("controlnet", 9), ("lora", 11)])
@pytest.mark.parametrize("bad", [ESCAPE, "..", "a/b", "a\\b", ".hidden", "", "x" * 65, "name with space"])
def test_a_name_that_is_not_plain_is_one_clear_error(tmp_path, capsys, tiny_sd15_dir, field, line, bad):
    path = tmp_path / "engines.yaml"
    path.write_text(_yaml(tiny_sd15_dir, **{field: bad}))
    assert main(["plan", str(path)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    message = " ".join(captured.err.split())
    assert f"{path}:{line}:" in message.replace(" ", "") or f"{path}:{line}:" in message
    assert "is not allowed" in message


def test_plain_names_are_accepted(tmp_path, tiny_sd15_dir):
    path = tmp_path / "engines.yaml"
    path.write_text(_yaml(tiny_sd15_dir, model="sd1.5_tiny-A", controlnet="canny-2", lora="style.v1"))
    config = load_engines_file(path)
    assert list(config.models) == ["sd1.5_tiny-A"]


def test_an_engine_name_is_one_path_component_whatever_the_model_name():
    spec = EngineSpec(model=ESCAPE, family="sd15", source="local:x", component="unet", target="onnxruntime",
                      precision="fp32", batch=1, bucket=None, controlnet="../cn")
    assert "/" not in spec.name and Path(spec.name).name == spec.name


def test_artifact_folders_stay_inside_the_workspace(tmp_path):
    from trt_diffusion.workspace.store import inside

    store = ArtifactStore(tmp_path / "ws")
    assert store.folder("onnx", ESCAPE, "0" * 64).parent == tmp_path / "ws" / "onnx"
    with pytest.raises(ConfigError, match="outside the workspace"):
        store.folder("..", "x", "0" * 64)
    with pytest.raises(ConfigError, match="outside the workspace"):
        inside(tmp_path / "ws", tmp_path / "ws" / "engines" / ".." / ".." / "elsewhere")
    assert inside(tmp_path / "ws", tmp_path / "ws" / "engines" / "a") == tmp_path / "ws" / "engines" / "a"
