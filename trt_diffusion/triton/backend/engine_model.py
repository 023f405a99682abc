"""A python-backend model running one ONNX Runtime engine (the bundled server has no onnxruntime backend).

The engine files lie in the model's version folder; the session is created exactly as the in-process
runner creates it (`onnxruntime_target.load_runner`), so both give the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import RuntimeInputError
from . import pb


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from ...build.onnxruntime_target import load_runner

        config = json.loads(args["model_config"])
        self.name = config["name"]
        folder = Path(args["model_repository"]) / args["model_version"]
        self.runner = load_runner(folder, name=self.name)
        self.output_names = [output["name"] for output in config["output"]]

    def execute(self, requests: list) -> list:
        utils = pb.utils()
        responses = []
        for request in requests:
            try:
                feeds = {name: pb.input_array(request, name) for name in self.runner.inputs}
                outputs = self.runner.run(feeds)
                responses.append(utils.InferenceResponse(
                    [utils.Tensor(name, outputs[name]) for name in self.output_names]))
            except RuntimeInputError as err:
                responses.append(pb.error_response(str(err)))
            except Exception as err:  # noqa: BLE001 - one bad request must not take the model down
                responses.append(pb.internal_error(self.name, err))
        return responses
