"""A python-backend model running one engine through its target's runner (the bundled server has only
the python backend).

The engine files lie in the model's version folder; the config's `target` parameter names the target,
whose `runner_from_files` creates the runner exactly as the in-process pipeline does, so both give the
same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import RuntimeInputError
from . import pb


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from ...targets import get_target

        config = json.loads(args["model_config"])
        self.name = config["name"]
        folder = Path(args["model_repository"]) / args["model_version"]
        target = config["parameters"]["target"]["string_value"]
        self.runner = get_target(target).runner_from_files(folder, self.name)
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
