"""Z-Image's engines as test_z_image_lora.py refits them (issue #42, acceptance 4): the tiny folder exported (the
transformer's graph dynamic over batch, latent size and the text axis) and built fp32 on onnxruntime and openvino
with CFG as one batch-2 call. Slow: the build is the session's `built_z_image` (conftest.py), shared with the LoRA
file. Parity on both targets, the served entry equal to the in-process pipeline (gRPC and HTTP, NUM_IMAGES 2) and its
CFG_NORMALIZATION / CFG_TRUNCATION inputs are the family conformance run's (tests/families/test_conformance.py:
test_parity[z_image/*], test_triton_answers_the_in_process_image[z_image],
test_declared_request_inputs_reach_the_entry[z_image]); Z-Image-Turbo's request (8 steps, guidance 0) equals
ZImagePipeline in test_z_image_reference.py."""

from __future__ import annotations

import onnx
import pytest

from trt_diffusion import api

from .conftest import FP32, MODEL, TARGETS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_builds_on_both_cpu_targets_with_the_batch_two_transformer(built_z_image):
    path, report = built_z_image
    done = {(o.spec.component.value, o.spec.target, o.spec.batch) for o in report.outcomes if o.failure is None}
    assert done == {(c, t, 2 if c == "transformer" else 1) for c in FP32 for t in TARGETS}
    (transformer,) = [r for r in api.export(path).results if r.group.name == f"{MODEL}.transformer.fp32"]
    graph = onnx.load(str(transformer.onnx_path), load_external_data=False)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.graph.input}
    assert dims == {"hidden_states": ["batch", 16, "latent_height", "latent_width"], "timestep": ["batch"],
                    "encoder_hidden_states": ["batch", "text_tokens", 16],
                    "encoder_hidden_states_mask": ["batch", "text_tokens"]}
    assert transformer.dynamic_ranges["text_tokens"] == [2, 512]
    assert all(check["passed"] for check in transformer.parity) and len(transformer.parity) == 3
