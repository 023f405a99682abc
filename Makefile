# make build-engines : the main job on engines.yaml (the embedded micro-model default works on a fresh machine)
# make test          : the test suite (what CI runs)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
CONFIG ?= engines.yaml
BIN := $(VENV)/bin
TD := $(BIN)/trt-diffusion
PYTEST_ARGS ?=
# Extra options for a target's trt-diffusion command: make build ARGS="--jobs 2", make serve SERVE_ARGS="--http-port 9000"
ARGS ?=
SERVE_ARGS ?=
MICRO := models/micro-sd15
# `models micro` writes this file into the folder it then renames into place, so it exists only in a whole model.
MICRO_STAMP := $(MICRO)/trt_diffusion_tiny.json
REPO ?= triton_repo
URL ?= 127.0.0.1:8000
# make serve also serves the OpenAI Images API here (http://127.0.0.1:$(OPENAI_PORT)/v1)
OPENAI_PORT ?= 8080
PROMPT ?= a red circle on a blue background
IMAGE ?= out.png
REFIT_ARGS ?= --model sd15-micro --base

.PHONY: venv models build-engines plan export quantize build refit test test-slow test-gpu parity package serve \
	generate preflight manifest lint clean

# The CPU build of torch goes in first: anything looser pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,openvino,farm,store,openai]'
	# The TensorRT API as .pyi for the type check; --no-deps: its metadata pulls TensorRT from NVIDIA's index.
	$(BIN)/pip install -q --no-deps tensorrt-stubs==10.13.0.35.1
	touch $@

venv: $(VENV)/.installed

# The embedded default: the SD1.5-family micro-model trained on the synthetic world, with its edge-map ControlNet
# and outlined-style LoRA (docs/micro-models.md). A file target, so a no-op make does not even start the command
# (which imports torch); delete the folder to write it again.
models: $(MICRO_STAMP)

$(MICRO_STAMP): | $(VENV)/.installed
	$(TD) models micro --family sd15 --out $(MICRO) --if-missing

plan: models
	$(TD) plan $(CONFIG) $(ARGS)

# One target per stage command; each stage reuses what is unchanged.
export: models
	$(TD) export $(CONFIG) $(ARGS)

quantize: models
	$(TD) quantize $(CONFIG) $(ARGS)

build: models
	$(TD) build $(CONFIG) $(ARGS)

# make refit REFIT_ARGS="--model sd15-micro --lora FILE[:SCALE]"; the default restores the base weights.
refit: build-engines
	$(TD) refit $(CONFIG) $(REFIT_ARGS)

# plan -> export (verified against PyTorch) -> quantize (fp8/int8 entries) -> build, each reusing what is unchanged
build-engines: models
	$(TD) plan $(CONFIG)
	$(TD) build $(CONFIG)

parity: build-engines
	$(TD) parity $(CONFIG) $(ARGS)

# The release manifest: every engine's provenance and sha256, verified (<workspace>/release-manifest.json).
manifest: build-engines
	$(TD) manifest $(CONFIG) $(ARGS)

# A Triton model repository from the built engines, then tritonserver on 127.0.0.1 and the OpenAI Images API on
# OPENAI_PORT (Ctrl-C stops both).
package: build-engines
	$(TD) package $(CONFIG) --out $(REPO) $(ARGS)

serve: package
	$(TD) serve --repo $(REPO) --openai-port $(OPENAI_PORT) $(SERVE_ARGS)

# The pre-launch checklist against a server it packages and starts on 127.0.0.1 (or ARGS="--url HOST:PORT"):
# build/reports/preflight/preflight.html; exit 1 when a check fails. The first run saves the quality baseline
# (where CONFIG keeps it: the command reads the file's workspace and preflight settings).
preflight: build-engines
	$(TD) preflight $(CONFIG) --save-baseline-if-missing $(ARGS)

# Ask a running server (make serve, in another shell) for an image.
generate: venv
	$(TD) generate --url $(URL) --prompt "$(PROMPT)" -o $(IMAGE) $(ARGS)

test: venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The slow suite spends most of its time in one thread (exports, Python loops over tiny models): two workers nearly
# halve it on CI's 2 cores. --dist loadfile keeps a module's tests, and the engines its fixtures build, on one worker.
SLOW_WORKERS ?= 2
test-slow: venv
	$(BIN)/python -m pytest -q -m slow -n $(SLOW_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

# A GPU host that reaches NVIDIA's index: TensorRT and cuda-python (the tensorrt extra), then the gpu suite.
# Without TensorRT, cuda-python or a CUDA device it stops first with one line naming what is missing.
NVIDIA_INDEX ?= https://pypi.nvidia.com
# The gpu suite in its own venv (.venv-gpu): a CUDA build of torch and the tensorrt extra, which the CPU venv
# must never pull. --system-site-packages: on a GPU image that has CUDA torch, cuda-python or TensorRT already
# (and no network), those are used. Without a CUDA device or CUDA torch it fails (it never skips); without
# TensorRT it runs the CUDA-only gpu tests and then fails, saying so (the last `make test-gpu:` line).
GPU_VENV ?= .venv-gpu
GPU_BIN := $(GPU_VENV)/bin
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/cu128
$(GPU_VENV)/.installed: pyproject.toml
	@mkdir -p build
	$(PYTHON) -m venv --system-site-packages $(GPU_VENV)
	-$(GPU_BIN)/pip install -q --retries 1 --timeout 30 --upgrade pip > build/test-gpu-install.log 2>&1
	-$(GPU_BIN)/python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null || \
		$(GPU_BIN)/pip install -q --retries 1 --timeout 30 torch==2.13.0 --index-url $(TORCH_CUDA_INDEX) \
		>> build/test-gpu-install.log 2>&1
	-$(GPU_BIN)/pip install -q --retries 1 --timeout 30 -e '.[tensorrt,test]' --extra-index-url $(NVIDIA_INDEX) \
		>> build/test-gpu-install.log 2>&1 || $(GPU_BIN)/pip install -q --no-deps --no-build-isolation -e . \
		>> build/test-gpu-install.log 2>&1
	touch $@

test-gpu: $(GPU_VENV)/.installed
	@mode=$$($(GPU_BIN)/python -m trt_diffusion.targets.tensorrt.host_check --mode --json build/gpu_host.json \
		--note "install log: build/test-gpu-install.log") || exit 1; \
	if [ "$$mode" = full ]; then $(GPU_BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS); \
	else rc=0; $(GPU_BIN)/python -m pytest -q -m "gpu and not tensorrt" $(PYTEST_ARGS) || rc=$$?; \
		echo "make test-gpu: TensorRT is missing (build/gpu_host.json): the CUDA-only gpu tests ran (pytest exit $$rc), the TensorRT ones did not"; \
		exit 1; fi

# ruff (pyflakes, isort, pyupgrade, pycodestyle errors; pyproject's [tool.ruff]) and pylint's duplicate-code
# check (R0801: 8+ similar lines, comments/docstrings/imports/signatures ignored) over the package.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/pylint --disable=all --enable=duplicate-code --min-similarity-lines=8 --score=n trt_diffusion

clean:
	rm -rf build triton_repo reports
