"""Error kinds.

A `TrtDiffusionError` is the user's to fix (bad engines.yaml, missing folder, failed parity gate):
the CLI prints its message and exits 1 with no traceback. Anything else is a bug in this tool
and exits 3 with the traceback.
"""


class TrtDiffusionError(Exception):
    """A problem the user can fix; its message must say what and where."""


class ConfigError(TrtDiffusionError):
    """engines.yaml (or another input file) is malformed or inconsistent."""

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = problems or [message]
        super().__init__(message)


class ModelError(TrtDiffusionError):
    """A model folder, checkpoint or LoRA file is missing, corrupt or of the wrong kind."""


class ExportError(TrtDiffusionError):
    """Export to ONNX failed or its parity check did not pass."""


class QuantizeError(TrtDiffusionError):
    """Quantization failed or its quality gate did not pass."""


class BuildError(TrtDiffusionError):
    """An engine could not be built, or was built for another TensorRT / GPU."""


class RefitError(TrtDiffusionError):
    """A LoRA does not fit the engine it was asked to refit."""


class RuntimeInputError(TrtDiffusionError):
    """A request or runner input does not match what the engine expects."""


class ParityError(TrtDiffusionError):
    """A parity gate failed."""


class ServeError(TrtDiffusionError):
    """The Triton model repository or server could not be prepared or started."""


class MissingDependencyError(TrtDiffusionError):
    """An optional dependency (TensorRT, a GPU) is needed for this step and is not present."""


class InternalError(Exception):
    """A bug in trt-diffusion found inside a stage that keeps going (one engine of many): not the user's
    to fix. Deliberately not a TrtDiffusionError, so the CLI exits 3 (cli/main.py)."""
