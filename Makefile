# `make repro` and `make test` work on a fresh clone: the first use creates .venv and installs
# the project; later uses reinstall only when pyproject.toml changed.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# DVC runs each stage's `python -m stages.x` through a shell: it must find the venv's python.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: help setup repro test ui lint bench ci-report
.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	@echo "installing the project into $(VENV) (first time: a few minutes)"
	$(PY) -m pip install -q -e '.[dev]' 2>&1 | { grep -v '^WARNING: Location' || true; }
	touch $(STAMP)

setup: $(STAMP) ## create .venv and install the project (only when pyproject.toml changed)

repro: setup ## run the whole pipeline: prepare, train, evaluate, export
	dvc repro

test: setup ## run the test suite
	$(PY) -m pytest

UI_PORT ?= 5000
ui: setup ## MLflow UI for every run, on http://127.0.0.1:5000 (UI_PORT=... to change)
	mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port $(UI_PORT) \
		--allowed-hosts 127.0.0.1:$(UI_PORT),localhost:$(UI_PORT) --workers 1

lint: setup ## ruff
	ruff check stages tests

bench: setup ## the loop ablation benchmark, side by side
	$(PY) -m stages.bench

BASE ?= main
ci-report: setup ## params, metrics and plots of the workspace against BASE (default main), as Markdown
	@echo "## Params: workspace vs $(BASE)"
	@dvc params diff $(BASE) --md
	@echo "## Metrics: workspace vs $(BASE)"
	@dvc metrics diff $(BASE) --md
	@dvc plots diff $(BASE) -o dvc_plots > /dev/null
	@echo "Plots: dvc_plots/index.html"
