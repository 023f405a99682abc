"""The optional-dependency gate (extras.py): a command that asks for an extra's feature on a host without the
extra exits 1 with one message naming `pip install 'trt-diffusion[extra]'`, and no traceback.

Each case runs the real CLI in a child process whose import system refuses the extra's module, the way a host that
never installed the extra lacks it (the modules are installed here): `None` in sys.modules makes `import` raise
ModuleNotFoundError and `importlib.util.find_spec` answer None, as for an absent package."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trt_diffusion.errors import ConfigError
from trt_diffusion.target_registry import register_target, unregister_target

# argv[1]: comma-separated top-level modules to refuse; argv[2:]: the CLI's arguments (or `-c CODE`)
BLOCKED = textwrap.dedent("""
    import sys

    for name in sys.argv[1].split(","):
        sys.modules[name] = None
    if sys.argv[2] == "-c":
        exec(sys.argv[3])
    else:
        from trt_diffusion.cli.main import main

        sys.exit(main(sys.argv[2:]))
""")


def run_without(modules: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED, modules, *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def assert_gate(result: subprocess.CompletedProcess, extra: str, feature: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert f"pip install 'trt-diffusion[{extra}]'" in output, output[-3000:]
    assert feature in output, output[-3000:]
    assert "Traceback" not in output and "internal error" not in output, output[-3000:]


@pytest.fixture
def engines_yaml(tmp_path) -> Path:
    """An engines.yaml whose model folder is absent: the gate must answer before the file is even read."""
    path = tmp_path / "engines.yaml"
    path.write_text("version: 1\nmodels:\n  m:\n    source: no-such-model\n    family: sd15\n"
                    "    buckets: ['64x64']\n")
    return path


def test_openai_api_without_uvicorn(tmp_path):
    result = run_without("uvicorn", "openai-api", "--port", "18081", cwd=tmp_path)
    assert_gate(result, "openai", "openai-api")
    assert "uvicorn" in result.stderr


def test_serve_openai_port_without_fastapi(tmp_path):
    # before tritonserver is started: the repository is not even looked at
    result = run_without("fastapi", "serve", "--repo", str(tmp_path / "no-repo"), "--openai-port", "18082",
                         cwd=tmp_path)
    assert_gate(result, "openai", "--openai-port")
    assert "fastapi" in result.stderr


def test_build_ray_without_ray(tmp_path, engines_yaml):
    result = run_without("ray", "build", str(engines_yaml), "--ray", "auto", cwd=tmp_path)
    assert_gate(result, "farm", "--ray")


def test_build_target_openvino_without_openvino(tmp_path, engines_yaml):
    result = run_without("openvino", "build", str(engines_yaml), "--target", "openvino", cwd=tmp_path)
    assert_gate(result, "openvino", "--target openvino")


def test_build_target_tensorrt_without_tensorrt(tmp_path, engines_yaml):
    result = run_without("tensorrt", "build", str(engines_yaml), "--target", "tensorrt", cwd=tmp_path)
    assert_gate(result, "tensorrt", "--target tensorrt")
    assert "--extra-index-url https://pypi.nvidia.com" in result.stderr  # TensorRT's wheels are not on PyPI


def test_s3_workspace_without_s3fs(tmp_path, tiny_sd15_dir, write_engines_yaml):
    config = write_engines_yaml(tmp_path, tiny_sd15_dir, "sd15", workspace="s3://bucket/ws")
    result = run_without("s3fs", "manifest", str(config), cwd=tmp_path)
    assert_gate(result, "store", "s3://bucket/ws")
    assert "s3fs" in result.stderr


def test_a_target_only_listed_in_defaults_is_skipped_with_the_pip_line(tmp_path):
    """Not asked for by name: availability() reports the reason (the build skips the target) and raises nothing."""
    code = ("from trt_diffusion.target_registry import availability\n"
            "print('REASON', availability()['openvino'])")
    result = run_without("openvino", "-c", code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REASON the openvino package is not installed" in result.stdout
    assert "pip install 'trt-diffusion[openvino]'" in result.stdout


def test_the_gate_names_the_module_and_passes_where_the_extra_is_installed():
    from trt_diffusion import extras

    assert extras.install_line("farm") == "pip install 'trt-diffusion[farm]'"
    assert extras.missing("openai") is None  # the test environment installs every CPU extra
    reason = extras.missing("tensorrt", ("json:Builder",))  # imports, but is not the real package
    assert reason and "has no Builder" in reason and "trt-diffusion[tensorrt]" in reason
    with pytest.raises(KeyError, match="unknown extra 'gpu'"):
        extras.install_line("gpu")


def test_register_target_refuses_a_taken_name():
    with pytest.raises(ConfigError, match="target 'onnxruntime' is already registered"):
        register_target("onnxruntime", "somewhere:Else")
    register_target("extras-test-target", "somewhere:Else")
    try:
        with pytest.raises(ConfigError, match="already registered"):
            register_target("extras-test-target", "elsewhere:Other")
    finally:
        unregister_target("extras-test-target")
