"""quantize/encoder.py's layer selection: a language-model encoder's layers the engine runs are quantized, the rest
(a vision tower, an LM head) left out by their outermost unused module; the defaults and engines.yaml still apply."""

from __future__ import annotations

import torch

from trt_diffusion.quantize.encoder import UNUSED, encoder_selection, run_layers
from trt_diffusion.quantize.exclusions import effective_patterns


class Language(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"q_proj": torch.nn.Linear(4, 4),
                                                               "down_proj": torch.nn.Linear(4, 4)}) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer["down_proj"](layer["q_proj"](x))
        return x


class Encoder(torch.nn.Module):
    """A language model beside a vision tower and an LM head, as Qwen2.5-VL's checkpoint holds them."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.language_model = Language()
        self.model.visual = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        self.lm_head = torch.nn.Linear(4, 8)


class Wrapper(torch.nn.Module):
    """What the engine computes: the decoder stack's states, no tower, no head."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module.model.language_model(x)


def test_the_layers_the_engine_runs_are_quantized_the_rest_left_out_whole():
    module = Encoder()
    ran = run_layers(Wrapper(module), module, {"x": torch.zeros(1, 4)})
    assert ran == {f"model.language_model.layers.{i}.{p}" for i in range(2) for p in ("q_proj", "down_proj")}
    selection = encoder_selection(module, ran, effective_patterns([]))
    assert set(selection.quantized) == ran
    assert selection.excluded == {"model.visual": UNUSED, "lm_head": UNUSED}  # one entry per unused module


def test_engines_yaml_patterns_still_exclude_run_layers():
    module = Encoder()
    ran = run_layers(Wrapper(module), module, {"x": torch.zeros(1, 4)})
    selection = encoder_selection(module, ran, effective_patterns(["*layers.1.*"]))
    assert selection.quantized == ("model.language_model.layers.0.q_proj", "model.language_model.layers.0.down_proj")
    assert selection.excluded["model.language_model.layers.1.q_proj"] == "*layers.1.*"
    assert selection.excluded["model.visual"] == UNUSED
