"""The runners the runtime itself makes: the PyTorch reference and a plain-function adapter, on the runner base
every target's runner shares (`targets/runner_base.py`: the lifecycle, the Runner protocol; `tensors.py`: TensorSpec)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..targets.runner_base import BaseRunner
from ..tensors import TensorSpec


class TorchRunner(BaseRunner):
    """The PyTorch reference: a module called with the same named inputs as the exported graph."""

    def __init__(self, module, inputs: dict[str, TensorSpec], output_names: Sequence[str], *, name: str):
        self.module, self.inputs, self.output_names, self.name = module, inputs, list(output_names), name

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        with torch.inference_mode():
            outputs = self.module(*[_tensor(feeds[k]) for k in self.inputs])
        if not isinstance(outputs, (tuple, list)):
            outputs = (outputs,)
        return {k: v.detach().float().numpy() if v.is_floating_point() else v.numpy()
                for k, v in zip(self.output_names, outputs)}


def _tensor(array: np.ndarray):
    """The feed as a tensor over the same memory, strides kept: the reference must see the layout diffusers'
    own pipeline gives its modules (a channels-last image makes convolutions round differently)."""
    import torch

    if any(s < 0 for s in array.strides):  # torch takes no negative strides
        array = np.ascontiguousarray(array)
    return torch.from_numpy(array)


class CallableRunner(BaseRunner):
    """Adapter for a plain function (tests, composite runners)."""

    def __init__(self, fn: Callable[[dict], dict], inputs: dict[str, TensorSpec], *, name: str):
        self.fn, self.inputs, self.name = fn, inputs, name

    def _run(self, feeds):
        return self.fn(feeds)
