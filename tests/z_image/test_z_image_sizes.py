"""docs/z-image.md's full-size table is what the released configs count on the meta device: each engine's
parameters and its weights per precision (issue #42, acceptance 4)."""

from __future__ import annotations

import re
from pathlib import Path

from trt_diffusion.models.tiny_z_image import released_parameter_counts, released_weight_bytes

DOC = Path(__file__).resolve().parents[2] / "docs" / "z-image.md"
ROWS = {"transformer": "transformer (", "text_encoder": "text encoder (", "vae_encoder": "VAE encoder |",
        "vae_decoder": "VAE decoder |"}


def _row(start: str) -> list[str]:
    (line,) = [line for line in DOC.read_text().splitlines() if line.startswith(f"| {start}")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_docs_table_is_the_meta_device_count():
    counts, weights = released_parameter_counts(), released_weight_bytes()
    assert counts["transformer"] == 6_154_908_736 and counts["text_encoder"] == 4_022_468_096
    for component, start in ROWS.items():
        _, parameters, fp32, half, quantized = _row(start)
        assert int(parameters.replace(",", "")) == counts[component]
        assert fp32 == f"{weights[component]['fp32'] / 1e9:.2f} GB"
        assert half == f"{weights[component]['bf16'] / 1e9:.2f} GB" == f"{weights[component]['fp16'] / 1e9:.2f} GB"
        if "int8" in weights[component]:
            assert quantized == f"{weights[component]['int8'] / 1e9:.2f} GB"
        else:
            assert quantized == "—" and not re.search(r"fp8", " ".join(weights[component]))
