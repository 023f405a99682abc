"""Crafted LoRA and checkpoint files (issue 32, finding 7): each is one ModelError naming the file and what
is wrong, never a traceback; non-finite alphas and weights are refused; a safetensors header is parsed
within a small multiple of its size."""

from __future__ import annotations

import json
import math
import struct
import tracemalloc

import pytest
import torch
from safetensors.torch import save_file

from trt_diffusion.errors import ModelError
from trt_diffusion.lora import lora_layers
from trt_diffusion.lora.files import read_lora_file
from trt_diffusion.models.single_file import checkpoint_keys
from trt_diffusion.models.weight_headers import read_header, stored_parameter_count

MODULE = "lora_unet_down_blocks_1_attentions_0_proj_in"
PEFT = "unet.down_blocks.1.attentions.0.proj_in"


def _kohya(alpha: torch.Tensor | None, rank: int = 2) -> dict[str, torch.Tensor]:
    tensors = {f"{MODULE}.lora_down.weight": torch.ones(rank, 16, 1, 1), f"{MODULE}.lora_up.weight": torch.ones(16, rank, 1, 1)}
    if alpha is not None:
        tensors[f"{MODULE}.alpha"] = alpha
    return tensors


def _peft(metadata: str | None) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    tensors = {f"{PEFT}.lora_A.weight": torch.ones(2, 16), f"{PEFT}.lora_B.weight": torch.ones(16, 2)}
    return tensors, None if metadata is None else {"lora_adapter_metadata": metadata}


def _raw(tmp_path, name: str, header: bytes, body: bytes = b"") -> str:
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)
    return path


@pytest.mark.parametrize("case,tensors,match", [
    ("alpha0", _kohya(torch.zeros(0)), r"alpha holds 0 values"),
    ("alpha2", _kohya(torch.ones(2)), r"alpha holds 2 values"),
    ("rank0", _kohya(torch.tensor(1.0), rank=0), r"lora_down.weight is empty .*rank 0"),
    ("alphainf", _kohya(torch.tensor(math.inf)), r"alpha is inf; an alpha must be a finite number"),
    ("alphanan", _kohya(torch.tensor(math.nan)), r"alpha is nan"),
    ("weightinf", {**_kohya(torch.tensor(1.0)), f"{MODULE}.lora_up.weight": torch.full((16, 2, 1, 1), math.inf)},
     r"lora_up.weight holds non-finite values"),
])
def test_crafted_lora_tensors_are_one_model_error(tmp_path, case, tensors, match):
    path = tmp_path / f"{case}.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(ModelError, match=rf"{case}.safetensors: .*{match}"):
        lora_layers(read_lora_file(path))


@pytest.mark.parametrize("case,metadata,match", [
    ("list", "[1, 2]", r"is a JSON list, not an object"),
    ("alphastr", json.dumps({"lora_alpha": "abc"}), r"lora_alpha is 'abc', not a finite non-negative number"),
    ("alphainf", '{"lora_alpha": Infinity}', r"lora_alpha is inf"),
    ("scoped", json.dumps({"unet.lora_alpha": [1]}), r"unet.lora_alpha is \[1\]"),
    ("pattern", json.dumps({"alpha_pattern": {"proj_in": "x"}}), r"alpha_pattern is not an object"),
    ("deep", "[" * 100_000 + "]" * 100_000, r"not JSON \(nested too deeply\)"),
])
def test_crafted_adapter_metadata_is_one_model_error(tmp_path, case, metadata, match):
    tensors, meta = _peft(metadata)
    path = tmp_path / f"{case}.safetensors"
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ModelError, match=rf"{case}.safetensors: its lora_adapter_metadata metadata.*{match}"):
        lora_layers(read_lora_file(path))


@pytest.mark.parametrize("case,header", [
    ("list", b"[1, 2]"), ("string", b'"text"'), ("deep", b"[" * 50_000 + b"]" * 50_000),
    ("emptyentries", b'{"a": {}, "b": {}}'), ("wrongtype", b'{"a": {"dtype": "F32", "shape": "x", "data_offsets": [0, 0]}}'),
])
def test_crafted_headers_are_one_model_error(tmp_path, case, header):
    path = _raw(tmp_path, f"{case}.safetensors", header)
    with pytest.raises(ModelError, match=rf"{case}.safetensors: not a .safetensors file"):
        read_header(path)
    with pytest.raises(ModelError, match=rf"{case}.safetensors"):
        checkpoint_keys(path)


def test_a_two_byte_unet_file_in_a_model_folder(tmp_path):
    unet = tmp_path / "unet"
    unet.mkdir()
    (unet / "diffusion_pytorch_model.safetensors").write_bytes(b"ab")
    with pytest.raises(ModelError, match=r"diffusion_pytorch_model.safetensors: not a .safetensors file \(2 bytes"):
        stored_parameter_count(unet)
    (unet / "diffusion_pytorch_model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ModelError, match=r"declares a header of 1099511627776 bytes"):
        stored_parameter_count(unet)


def test_real_headers_read_as_before(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({'a.b"c': torch.zeros(3, 4, dtype=torch.float16), "scalar": torch.zeros(()),
               "empty": torch.zeros(0, 2, dtype=torch.int64)}, str(path), metadata={"note": 'x " {[', "k": "v"})
    read = {name: {"dtype": e["dtype"], "shape": list(e["shape"])} for name, e in read_header(path).items()}
    assert read == {'a.b"c': {"dtype": "F16", "shape": [3, 4]}, "scalar": {"dtype": "F32", "shape": []},
                                 "empty": {"dtype": "I64", "shape": [0, 2]}}
    assert stored_parameter_count(tmp_path) == 13


def test_a_20_mb_header_of_empty_objects_costs_little_memory(tmp_path):
    """Peak Python allocations while the header is read (tracemalloc): json.loads of such a header took
    ~19x its size (375 MB for 20 MB); the bound is 4x."""
    entries = b",".join(b'"k%d":{}' % i for i in range(1_500_000))
    path = _raw(tmp_path, "big.safetensors", b"{" + entries + b"}")
    del entries
    size = path.stat().st_size
    tracemalloc.start()
    try:
        with pytest.raises(ModelError, match="big.safetensors: not a .safetensors file"):
            read_header(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 4 * size, f"parsing a {size}-byte header took {peak} bytes"
