# make build-engines : the main job on engines.yaml (the embedded tiny default works on a fresh machine)
# make test          : the test suite (what CI runs)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
CONFIG ?= engines.yaml
BIN := $(VENV)/bin
TD := $(BIN)/trt-diffusion
PYTEST_ARGS ?=

.PHONY: venv models build-engines plan test test-slow test-gpu parity package serve clean

# The CPU build of torch goes in first: anything looser pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# The embedded default: a tiny seeded SD1.5-family pipeline with a ControlNet and a LoRA.
models: venv
	$(TD) models tiny --family sd15 --controlnet --lora --out models/tiny-sd15 --if-missing

plan: models
	$(TD) plan $(CONFIG)

# plan -> export (verified against PyTorch) -> quantize (fp8/int8 entries) -> build, each reusing what is unchanged
build-engines: models
	$(TD) plan $(CONFIG)
	$(TD) build $(CONFIG)

parity: models
	$(TD) parity $(CONFIG)

test: venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-slow: venv
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

clean:
	rm -rf build triton_repo reports
