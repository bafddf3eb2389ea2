# `make repro` and `make test` work on a fresh clone: the first use creates .venv and installs
# exactly requirements.lock; later uses reinstall only when the lock changed.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
USER_PATH := $(PATH)
# DVC runs each stage's `python -m stages.x` through a shell: it must find the venv's python.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: help setup lock repro verify share sync sweep test ui s3 server serve exps lint bench bench-pipeline bench-serve bench-data gpu-check ci-report plots-template clean
.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

# --no-deps: nothing but the lock, every file checked against its hashes. Then the project's two
# packages, the platform (reprotrain/) and the experiment (stages/), as pyproject.toml declares
# them: editable, so the checkout's code is what runs, and a command run in another clone (DVC's
# `python -m stages.x` in its folder) imports that clone's own.
# The interpreter that makes .venv, found on the PATH before .venv's bin (PYTHON=python3.12 picks
# another). A .venv without the stamp is made again unless its python is >= 3.11: a wrong
# Python's .venv (its pip fails on the lock) is never reused.
PYTHON ?= python3
version = $$(PATH='$(USER_PATH)' $(1) --version 2>&1 | awk '/^Python /{print $$2}' || true)
# The stamp holds the hash of what it installed, not a time: a fresh clone sharing this .venv (a
# CI runner's, a second checkout's) has newer files and the same lock, and installs nothing.
# (cksum: POSIX, on macOS too; a checksum and a length, enough to see a change)
LOCKED := $(shell cat requirements.lock 2>/dev/null | cksum | tr ' ' -)
$(STAMP): $(if $(filter $(LOCKED),$(shell cat $(STAMP) 2>/dev/null)),,FORCE)
	@v=$(call version,$(PYTHON)); printf '3.11\n%s\n' "$$v" | sort -VC || { echo "error: Python \
	>= 3.11 needed, but $(PYTHON) is $${v:-not found} ($$(PATH='$(USER_PATH)'; command -v $(PYTHON) \
	|| echo not on PATH)); pick another: make PYTHON=python3.11" >&2; exit 1; }
	@v=$(call version,$(PY)); printf '3.11\n%s\n' "$$v" | sort -VC \
		|| PATH='$(USER_PATH)' $(PYTHON) -m venv --clear $(VENV)
	@echo "installing requirements.lock into $(VENV): 7 GB, 6 to 10 minutes the first time, more" \
		"on a busy machine (torch's CUDA libraries; docs/install.md)"
	@# A numbered line per package as pip takes it, a line for each 30 s pip stays silent, a
	@# count at the end (reprotrain/pip_progress.py: standard library, runs before anything is installed).
	@$(PY) -m pip install --progress-bar off --require-hashes --no-deps -r requirements.lock 2>&1 \
		| $(PY) -m reprotrain.pip_progress --total $$(grep -c '^[a-zA-Z0-9].*==' requirements.lock)
	$(if $(wildcard pyproject.toml),$(PY) -m pip install --quiet --no-deps --no-build-isolation \
		--no-index --editable .)
	@echo $(LOCKED) > $(STAMP)

FORCE:
setup: $(STAMP) ## create .venv and install exactly requirements.lock (only when it changed)

# Resolved for Linux x86_64 and Python 3.11, the platform the lock installs on, under the
# committed lock-constraints.txt: the same lock on every machine.
lock: setup ## refresh requirements.lock from pyproject.toml (uv pip compile, with hashes)
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --generate-hashes --quiet \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 \
		--constraint lock-constraints.txt --custom-compile-command "make lock" \
		-o requirements.lock

# params.yaml checked first (bounded, in a second): DVC reads it whole before any stage runs,
# and expands YAML aliases without a limit (a 1.9 KB "billion laughs" file: gigabytes, minutes).
# Then one line when dvc.lock names a model no one shared (DVC will train again, and says only
# "Unable to pull"). After: one line when the model was made under another CPU or thread count
# than this machine's (restored from DVC's run-cache, which cannot tell): 3 s of importing torch.
repro: setup ## run the whole pipeline: prepare, train, evaluate, export
	@$(PY) -m stages.params
	@$(PY) -m reprotrain.team.share --advise
	dvc repro
	@$(PY) -m reprotrain.team.verify --here

# Every output's hash is in dvc.lock; a forced rerun of every stage must give the same bytes.
verify: setup ## rerun every stage from scratch; fail unless each output is byte-identical to dvc.lock
	@$(PY) -m stages.params
	@mkdir -p .dvc/tmp && cp dvc.lock .dvc/tmp/dvc.lock.before-verify
	dvc repro -f
	@$(PY) -m reprotrain.team.verify .dvc/tmp/dvc.lock.before-verify

# Silent (`@`), as every target that takes or reads a URL or DSN: make's echo of a recipe line
# would show what it holds (CI logs keep it); the values reach such recipes through the
# environment, so that even `make -n` shows only the variables' names.
share: setup ## push outputs and run-cache to the DVC remote, so another machine restores, not reruns
	@$(PY) -m reprotrain.team.share

# An Optuna study of DVC experiments (docs/sweeps.md). STORAGE is the study's database, its
# default $REPROTRAIN_SWEEP_STORAGE; it and REMOTE (a git URL may hold a token) go through the
# environment.
SWEEP ?= sweeps/lr.yaml
WORKERS ?= 1
LAUNCHER ?= local
REMOTE ?= origin
sweep: export REPROTRAIN_SWEEP_STORAGE := $(or $(STORAGE),$(REPROTRAIN_SWEEP_STORAGE))
sweep: export REPROTRAIN_SWEEP_REMOTE := $(REMOTE)
sweep: setup ## an Optuna study of DVC experiments: SWEEP=sweeps/lr.yaml TRIALS= WORKERS= LAUNCHER=local|slurm STORAGE= REMOTE=
	@$(PY) -m reprotrain.sweep run $(SWEEP) --workers $(WORKERS) --launcher $(LAUNCHER) \
		--remote "$$REPROTRAIN_SWEEP_REMOTE" $(if $(TRIALS),--trials $(TRIALS)) $(if $(STUDY),--study $(STUDY))
# The runs a stage spooled while the tracking server was down (.mlflow-spool/), or with
# FROM=sqlite:///path/mlflow.db a machine's own runs, onto MLFLOW_TRACKING_URI; exactly once.
FROM ?=
sync: export REPROTRAIN_SYNC_FROM := $(FROM)
sync: setup ## send spooled runs to the MLflow server (FROM=sqlite:///.../mlflow.db: move local runs up)
	@$(PY) -m reprotrain.tracking.sync $(if $(FROM),--from "$$REPROTRAIN_SYNC_FROM")

# A worker per core (`nproc`, which counts the cores this process may use: a container's or a
# SLURM job's share): a pipeline run is mostly single-threaded start-up. More than the cores
# costs more than the waits it fills: on the 2-core VM a third worker took the suite's CPU time
# from 44 to 57 minutes and its wall time from 26 to 32 (docs/performance.md, "Tests").
# loadscope keeps each module on one worker: its module-scoped trained repo is made once;
# the longest modules go first (tests/conftest.py).
# --durations: the slowest tests, to see where the suite's minutes go.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
# The warm processes the suite's pipelines started (reprotrain/warm.py) end with it, not 5
# idle minutes later: the test session stops them itself (tests/conftest.py), and only them.
test: setup ## run the test suite (TEST_WORKERS=... processes, one per core by default)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=20

UI_PORT ?= 5000
ui: setup ## MLflow UI for every run, on http://127.0.0.1:5000 (UI_PORT=... to change)
	@$(PY) -m reprotrain.team.ui --port $(UI_PORT)

# A real S3 server on loopback (SeaweedFS) to try a DVC remote and MLflow's artifacts on object
# storage: it prints its keys and the commands that use them.
S3_PORT ?= 9000
s3: setup ## a local S3 server on http://127.0.0.1:9000 (S3_PORT=... to change), data in .s3/
	@$(PY) -m reprotrain.team.s3 --port $(S3_PORT)

# Target-specific: `make server` has a PORT of its own.
serve: PORT ?= 5001
serve: setup ## the registry's champion over HTTP on http://127.0.0.1:5001 (PORT=... to change): /ping, /invocations
	@$(PY) -m reprotrain.serving.app --port $(PORT)
# The team's server (docs/server.md). The admin's login and the Flask secret
# key come from the environment (MLFLOW_TRACKING_USERNAME/PASSWORD, MLFLOW_FLASK_SERVER_SECRET_KEY),
# never from the command line, where `ps` would show them.
HOST ?= 127.0.0.1
ALLOWED_HOSTS ?=
# The values reach the recipe through the environment: quoted into the line, a quote or a
# blank in DB (`password='a b'`) split it, and the server never saw the password it refuses.
server: export REPROTRAIN_SERVER_ARGS_DB := $(DB)
server: export REPROTRAIN_SERVER_ARGS_ARTIFACTS := $(ARTIFACTS)
server: setup ## the team's MLflow server with logins: DB=postgresql://... ARTIFACTS=dir|s3://... PORT=5000
	@$(PY) -m reprotrain.team.server --db "$$REPROTRAIN_SERVER_ARGS_DB" \
		--artifacts "$$REPROTRAIN_SERVER_ARGS_ARTIFACTS" --port '$(PORT)' --host '$(HOST)' \
		--allowed-hosts '$(ALLOWED_HOSTS)'

# Headline metrics, lr, epochs and batch_size always; other params only where the rows differ;
# no dependency hashes or timestamps. As CSV aligned by `column`: 4 decimals and 2 spaces between
# columns fit 120 where dvc's own table does not. awk names the test split's metrics test_acc,
# test_loss, test_f1 (beside best_val_acc from validation), names the workspace and main rows
# (their Experiment cell is empty) from the rev column and drops it. `dvc exp show` has it all.
# The column sorted by is always shown (a sweep's objective, best_val_loss, among them).
EXPS_KEEP = ^(Experiment|rev|accuracy|macro_f1|loss|best_val_acc|lr|epochs|batch_size$(if $(EXPS_SORT),|$(lastword $(subst :, ,$(EXPS_SORT)))))$$
# Every column but those kept (--keep protects them) and params: a param's column is a top-level
# key of params.yaml, or one and a dot. Dependency columns are paths, and a dataset folder at the
# top (`shapes`, a 40-character hash) looks like any other name: only this rule drops them all.
EXPS_DROP = (?!($(shell awk -F: '/^[a-z_]+:/ {printf "%s%s", sep, $$1; sep = "|"}' params.yaml))(\.|$$))
# Every experiment, whatever commit it was made on: `dvc exp show` alone shows HEAD's, so a
# commit (docs/data.md's "add shapes") hid all earlier ones. HEAD's, then those of each commit
# `dvc exp list --all-commits` lists (a branch's tip by its name); e.g. EXPS_REVS='--rev HEAD'.
EXPS_REVS ?= --rev HEAD $$(dvc exp list --all-commits | sed -n 's/^\([^[:space:]].*\):$$/--rev \1/p')
EXPS_SORT ?=  # e.g. models/train/metrics.json:best_val_acc (a sweep prints its objective's)
EXPS_ORDER ?= desc
exps: setup ## experiments side by side, 120 columns: lr, epochs, batch_size, headline metrics
	@dvc exp show --csv --only-changed --precision 4 $(EXPS_REVS) \
		$(if $(EXPS_SORT),--sort-by '$(EXPS_SORT)' --sort-order $(EXPS_ORDER)) \
		--keep '$(EXPS_KEEP)' --drop '$(EXPS_DROP)' \
		| awk -F, -v OFS=, 'BEGIN { test["accuracy"] = "test_acc"; test["loss"] = "test_loss"; \
			test["macro_f1"] = "test_f1" } NR == 1 { for (i = 1; i <= NF; i++) if ($$i in test) $$i = test[$$i] } \
			{ $$2 = ($$1 == "" ? $$2 : $$1); $$1 = ""; sub(/^,/, ""); print }' \
		| { command -v column > /dev/null && column -t -s, || cat; }

lint: setup ## ruff
	ruff check stages reprotrain tests

bench: setup ## the loop ablation benchmark, side by side
	$(PY) -m reprotrain.bench.training

BENCH_REVS ?= HEAD
bench-pipeline: setup ## the stages part by part, cold and warm, embedded store and server; BENCH_REVS=a,b side by side
	$(PY) -m reprotrain.bench.training --pipeline --server --revs $(BENCH_REVS)

bench-serve: setup ## `make serve` first start and restart vs `mlflow models serve` vs in-process predict, side by side
	$(PY) -m reprotrain.bench.serving

bench-server: setup ## `make server` until ready, first start and restart; BENCH_REVS=a,b side by side
	$(PY) -m reprotrain.bench.server --revs $(BENCH_REVS)

bench-sync: setup ## `make sync` with no spool, of one run and again, against the team server; BENCH_REVS=a,b
	$(PY) -m reprotrain.bench.sync --revs $(BENCH_REVS)

bench-storage: setup ## DVC on a folder remote vs S3 on loopback: the pipeline's outputs and a 1 GiB dataset
	$(PY) -m reprotrain.bench.storage

bench-data: setup ## shards at 10k to 1M JPEGs: generate, prepare, push/pull, stream vs ImageFolder vs tensors; SIZES=10000,100000
	$(PY) -m reprotrain.bench.data $(if $(SIZES),--sizes $(SIZES))

# The CUDA path's checks (tests/experiment/test_gpu.py, which skip without CUDA) and the GPU bench rows, in
# one run for a lent GPU machine: within 8 minutes (each step has its own limit, `timeout` the
# whole), results in gpu-check/ even on failure, gpu-check/summary.md one screen.
# GPU_CHECK_DRY=1 runs the steps on the CPU at tiny sizes. Its python may come with the
# requirements already: `make gpu-check PY=python3` then skips creating .venv (that needs PyPI).
GPU_CHECK_OUT ?= gpu-check
gpu-check: $(if $(filter command line,$(origin PY)),,setup) ## on a GPU machine: the CUDA tests and the GPU bench, into gpu-check/ (GPU_CHECK_DRY=1: on the CPU)
	@# No NVIDIA device node: one line now, not after torch's import.
	@[ "$$GPU_CHECK_DRY" = 1 ] || ls /dev/nvidia[0-9]* > /dev/null 2>&1 || { echo "gpu-check: no NVIDIA \
	GPU on this machine (no /dev/nvidia0); GPU_CHECK_DRY=1 runs its steps on the CPU" >&2; exit 1; }
	@GPU_CHECK_OUT=$(GPU_CHECK_OUT) timeout -k 10 480 $(PY) -m reprotrain.bench.gpu_check

# Its tool gets a venv of its own: installed into .venv, it would break the lock's promise.
PLOTS_VENV := .dvc/tmp/plots-venv
plots-template: ## rebuild .dvc/plots/offline.html (Vega inlined, so plots render offline)
	@test -x $(PLOTS_VENV)/bin/python || $(PYTHON) -m venv $(PLOTS_VENV)
	$(PLOTS_VENV)/bin/python -m pip install -q --require-hashes -r .dvc/plots/requirements.txt
	$(PLOTS_VENV)/bin/python .dvc/plots/make_template.py

BASE ?= main
ci-report: setup ## params, metrics and plots of the workspace against BASE (default main), as Markdown
	@echo "## Params: workspace vs $(BASE)"
	@dvc params diff $(BASE) --md
	@echo "## Metrics: workspace vs $(BASE)"
	@dvc metrics diff $(BASE) --md --all
	@dvc plots diff $(BASE) -o dvc_plots > /dev/null
	@echo "Plots: dvc_plots/index.html"

clean: ## remove scratch: checkpoints, rendered plots, bench and test caches (keeps runs, data, DVC cache)
	rm -rf .checkpoints dvc_plots bench gpu-check .pytest_cache .ruff_cache $(PLOTS_VENV)
	find . -path ./.venv -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
	@echo "kept: mlflow.db and mlartifacts/ (run history), data/, models/, .dvc/cache (dvc gc prunes it)"
