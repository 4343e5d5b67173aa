# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv in the repository root. torch is pinned to the CPU build
# that lies on disk (an unpinned torch downloads a multi-GB CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install demo test test-slow test-multirank test-all bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-ci.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -r requirements-ci.txt
	# DeepSpeed and bitsandbytes build against the torch above, not a fresh one.
	$(PIP) --no-build-isolation deepspeed==0.19.8 bitsandbytes==0.50.2
	$(PIP) --no-deps -e .
	touch $@

demo: install
	$(VENV)/bin/oomless demo

test: install
	$(PY) -m pytest

# The longer checks: several processes, kill -9 and resume, version sweeps. CI runs them
# after `make test`.
test-slow: install
	$(PY) -m pytest -m "slow and not gpu"

# Only the tests that train on two gloo ranks (part of test-slow).
test-multirank: install
	$(PY) -m pytest -m "multirank and not gpu"

test-all: install
	$(PY) -m pytest -m "not gpu"

bench: install
	$(PY) benchmarks/speed.py
	$(PY) benchmarks/accuracy.py

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
