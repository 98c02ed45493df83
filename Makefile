# Two commands do everything on a fresh machine:
#   make run   — install the CPU serving stack, build the tiny model, start Ray on loopback and
#                serve the CPU profile (1 prefill + 2 decode vLLM engines, KV over NIXL)
#   make test  — install the same stack and run the whole test suite against it
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.disagg-installed
BUILT := $(VENV)/.disagg-built
export DISAGG_TRACE_DIR ?= $(abspath data/traces)
export RAY_USAGE_STATS_ENABLED := 0
export RAY_AUTH_MODE := disabled
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0

.PHONY: run test install unit sim lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "pip==26.3"  # tests/test_gpu_extra.py resolves with its fast-deps feature
	# torch's CPU build first: a plain resolve would pull a several-GB CUDA build
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[cpu,test,bench]"
	# the `nixl` meta package wants both CUDA flavours: take only its Python layer
	$(PIP) install -q --no-deps "nixl==1.5.0"
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break transformers' imports
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP) $(BUILT)

# the compiled engine model (setup.py), rebuilt whenever its source changes
$(BUILT): $(STAMP) setup.py disagg/core/engine_model.py
	$(PIP) install -q --no-deps -e .
	touch $(BUILT)

install: $(STAMP) $(BUILT)

run: install
	$(PY) -m serve_app.launch --config deployments/local.yaml --fit-host

# one Ray cluster per machine at a time: the two-node stack and the 64-engine rig get a pytest
# session each
test: install
	$(PY) -m pytest -q -p no:cacheprovider --timeout=1800 -m "not multinode and not rig" tests
	$(PY) -m pytest -q -p no:cacheprovider --timeout=900 -m multinode tests/multinode
	$(PY) -m pytest -q -p no:cacheprovider --timeout=900 -m rig tests/rig

# everything but the real-stack tests (no Ray cluster, no engines)
unit: install
	$(PY) -m pytest -q -p no:cacheprovider -m "not stack and not rig" tests

sim:
	$(PY) -m disagg.cli sim --trace azure_conv_2023 --saturation \
		--policies round_robin,least_loaded,length_heuristic,marginal_cost,oracle,pair_cost

clean:
	rm -rf $(VENV) .cache build *.egg-info disagg/core/*.so disagg/core/compiled-sources.json
