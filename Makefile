# Quick start: `make demo` (the main job) and `make test` (the test suite).
# Both create .venv on first use and install what they need into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRAS ?= dev,demo,net,jax

.PHONY: demo test lint bench install clean

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

# SGLang's HiCache module for tests/integrations/test_sglang_hicache.py: sglang itself without
# its dependency tree (a GPU stack), plus exactly what its hicache_storage and storage-factory
# imports need on a CPU machine.
SGLANG_TEST_DEPS := orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 pillow==13.0.0 \
	starlette==1.10.0 triton==3.9.0 ipython==9.18.1 aiohttp==3.14.5

# Ray for tests/integrations/test_ray_weight_sync.py and examples/ray_weight_sync (the ray extra).
$(VENV)/.test-extras: $(VENV)/.installed
	$(PIP) install -q --no-deps "sglang==0.5.23"
	$(PIP) install -q $(SGLANG_TEST_DEPS) "ray==2.60.0"
	touch $@

# ruff over everything; mypy strict over the layers up to disagg and weights (pyproject's
# [tool.mypy] overrides) and the leaves they import.
MYPY_STRICT := src/tiersync/layout src/tiersync/tiers src/tiersync/transfer src/tiersync/store src/tiersync/net \
	src/tiersync/disagg src/tiersync/weights \
	src/tiersync/completion.py src/tiersync/errors.py src/tiersync/sizes.py src/tiersync/settings.py src/tiersync/iov.py
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests examples fuzz setup.py
	$(VENV)/bin/ruff format --check src tests examples fuzz setup.py
	$(VENV)/bin/mypy $(MYPY_STRICT)

test: $(VENV)/.installed $(VENV)/.test-extras lint
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(VENV)/.installed
	$(VENV)/bin/tiersync bench d2h
	$(VENV)/bin/tiersync bench h2d

clean:
	rm -rf $(VENV) build src/*.egg-info src/tiersync/transfer/*.so src/tiersync/net/*.so
