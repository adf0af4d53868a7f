# Two commands do all the set-up on a fresh machine:
#   make demo   -> creates .venv, installs the pinned CPU stack, runs the main job (embedded default)
#   make test   -> creates .venv, installs the pinned CPU stack, runs the test suite
PY ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/pip
STAMP = $(VENV)/.installed
VLLM_VENV ?= .venv-vllm
VLLM_STAMP = $(VLLM_VENV)/.installed

.PHONY: venv vllm-venv demo test bench clean gpu-wheels

$(STAMP): setup.py requirements/cpu.in requirements/constraints.txt requirements/nodeps.txt
	$(PY) -m venv $(VENV)
	$(PIP) install -q -c requirements/constraints.txt -r requirements/cpu.in
	$(PIP) install -q --no-deps -r requirements/nodeps.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

# vLLM (rollout.engine=vllm) in its own venv: it pins its own dependencies. Ray actors run this
# venv's python, so it has the main venv's Python, ray and transformers, and hacpo (editable).
$(VLLM_STAMP): requirements/vllm.in requirements/constraints-vllm.txt
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -c requirements/constraints-vllm.txt torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -c requirements/constraints-vllm.txt -r requirements/vllm.in
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/hacpo train

test: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/python -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_algorithms.py
	$(VENV)/bin/python benchmarks/bench_logprobs.py

clean:
	rm -rf $(VENV) $(VLLM_VENV)

# megatron-core's wheel for a lent GPU machine's Python 3.12 (benchmarks/device_run.sh; the
# machine cannot download): into the git-ignored .whl/, carried along by the device call
gpu-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 megatron-core==0.16.1 -d .whl
