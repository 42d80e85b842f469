# Everything runs from a local virtualenv that `make install` creates, so a
# fresh machine needs nothing but python3.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
MODEL_DIR ?= runs/pretrain
TRAIN_GIN ?= gin/pretrain_moe.gin
PYTEST_ARGS ?=

.PHONY: install train test test-fast docs-check bench lint clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

train: install
	$(BIN)/t5lite-train --gin_file=$(TRAIN_GIN) --gin.MODEL_DIR="'$(MODEL_DIR)'"

# Everything but the documentation runs, which `make docs-check` does.
test: install
	$(BIN)/python -m pytest -q -n 2 --durations=15 -m "not docs" tests $(PYTEST_ARGS)

# Every command in README.md and docs/, CI-sized, and the newcomer path.
docs-check: install
	$(BIN)/python -m pytest -q -n 2 -m docs tests $(PYTEST_ARGS)

# Unit tests only, for quick loops; `make test` runs everything.
test-fast: install
	$(BIN)/python -m pytest -q -n 2 -m "not slow" tests $(PYTEST_ARGS)

# Training performance report (MFU, framework overhead, input pipeline,
# compile time, host memory) of gin/benchmarks/{dense,moe}.gin, then the
# checkpoint, decoding and checkpoint-import benchmarks; figures in
# benchmarks/results/ and docs/performance.md. On a GPU machine:
# benchmarks/gpu.sh.
bench: install
	$(BIN)/python benchmarks/run.py
	$(BIN)/python benchmarks/checkpoint_blocking.py
	$(BIN)/python benchmarks/decode.py
	$(BIN)/python benchmarks/import_throughput.py

lint: install
	$(BIN)/ruff check t5lite tests benchmarks
	$(BIN)/python -m pytest -q tests/test_gin_files.py

clean:
	rm -rf $(VENV) *.egg-info build dist
