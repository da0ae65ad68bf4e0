# Quick start: `make demo` (the main job) and `make test` (the test suite).
# Both create .venv on first use and install what they need into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRAS ?= dev,demo,net,jax

.PHONY: demo test bench install clean

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch==2.13.0 is the CPU build; a bare `torch` would pull a multi-GB CUDA build.
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/tiersync demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(VENV)/.installed
	$(VENV)/bin/tiersync bench d2h
	$(VENV)/bin/tiersync bench h2d

clean:
	rm -rf $(VENV) build src/*.egg-info src/tiersync/transfer/*.so src/tiersync/net/*.so
