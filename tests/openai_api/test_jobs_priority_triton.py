"""The real tritonserver (bundled in nvidia-pytriton) loads an entry config with the dynamic batcher's two priority
levels as configs.pipeline_config writes it, and serves a request at each level (the batch level the API's jobs
send, and none: interactive)."""

from __future__ import annotations

import numpy as np
import pytest

from trt_diffusion.triton import configs

pytestmark = [pytest.mark.slow, pytest.mark.triton, pytest.mark.timeout(300)]

MODEL_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", (x + 1).astype(np.int32))]))
        return out
'''


def test_a_real_tritonserver_serves_both_priority_levels(tmp_path):
    import tritonclient.grpc as grpc_client
    from google.protobuf import text_format

    from trt_diffusion.triton.contract import TensorDecl
    from trt_diffusion.triton.server import TritonServer

    config = configs.pipeline_config(
        "echo", stage="full", inputs=[TensorDecl("X", "TYPE_INT32", (1,))],
        outputs=[TensorDecl("Y", "TYPE_INT32", (1,))], instances=2, queue=configs.QueuePolicy(4, 60.0),
        parameters={})
    assert config.dynamic_batching.priority_levels == configs.PRIORITY_BATCH
    folder = tmp_path / "repo" / "echo"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(text_format.MessageToString(config))
    (folder / "1" / "model.py").write_text(MODEL_PY)
    server = TritonServer(tmp_path / "repo", tmp_path / "work", log_path=tmp_path / "triton.log")
    server.start()
    try:
        client = grpc_client.InferenceServerClient(server.grpc_url)
        for priority in (0, configs.PRIORITY_BATCH):  # 0: none sent, the default (interactive) level
            tensor = grpc_client.InferInput("X", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[41]], np.int32))
            result = client.infer("echo", [tensor], priority=priority)
            assert result.as_numpy("Y").tolist() == [[42]]
        loaded = client.get_model_config("echo").config.dynamic_batching  # what the server took, not what we wrote
        assert (loaded.priority_levels, loaded.default_priority_level) == (2, 1)
    finally:
        server.stop()
