"""The S3 workspace the farm tests share: moto_server on 127.0.0.1 (loopback only), one per test module, and a
fresh bucket per test named by the module's BUCKET, with credentials and endpoint where fsspec looks for them."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    """moto_server on 127.0.0.1 (no other interface), with the bucket made; its endpoint URL."""
    binary = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if binary is None:
        pytest.skip("moto_server is not installed (the test extra: pip install 'trt-diffusion[test]')")
    port = _free_port()
    process = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    pytest.fail("moto_server did not start")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """Credentials and endpoint the way fsspec finds them (environment and fsspec's config), a fresh bucket
    (the requesting module's BUCKET)."""
    import fsspec.config
    import s3fs

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": s3_server})
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(endpoint_url=s3_server)
    bucket = request.module.BUCKET
    if fs.exists(bucket):
        fs.rm(bucket, recursive=True)
    fs.mkdir(bucket)
    return fs
