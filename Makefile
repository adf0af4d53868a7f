# Two commands do all the set-up on a fresh machine:
#   make demo   -> creates .venv, installs the pinned CPU stack, runs the main job (embedded default)
#   make test   -> creates .venv, installs the pinned CPU stack, runs the test suite
PY ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/pip
STAMP = $(VENV)/.installed

.PHONY: venv demo test bench clean

$(STAMP): setup.py requirements/cpu.in requirements/constraints.txt requirements/nodeps.txt
	$(PY) -m venv $(VENV)
	$(PIP) install -q -c requirements/constraints.txt -r requirements/cpu.in
	$(PIP) install -q --no-deps -r requirements/nodeps.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hacpo train

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_algorithms.py
	$(VENV)/bin/python benchmarks/bench_logprobs.py

clean:
	rm -rf $(VENV)
