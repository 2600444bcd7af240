# vip: every target sets up (or refreshes) the virtual environment .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vip-installed
PRESET ?= tiny

export VIP_HOME ?= $(CURDIR)/.vip

.PHONY: setup test test-slow run

# torch==2.14.1 and torchvision==0.29.1 come from this machine's disk through pip. img2dataset pulls in
# the 2018 `dataclasses` backport, which shadows the standard library inside Prefect's server: removed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip uninstall -y -q dataclasses
	touch $@

setup: $(STAMP) gl-libs

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

# ------------------------------------------------------------------------------------------ the pipeline
# The config of every target that runs a flow (docs/settings.md): PRESET, then CONFIG=my.yaml (a file of some or all
# fields, as `vip config show` prints), then SET='privacy.target_epsilon=4 private.steps=20' (space-separated
# FIELD=VALUE settings, each value read as YAML), a later one winning.
CONFIG ?=
SET ?=
CONFIG_OPTIONS = --preset $(PRESET) $(if $(CONFIG),--config '$(CONFIG)') $(foreach setting,$(SET),--set '$(setting)')

# `make run`: the whole pipeline (the Prefect flow vip-pipeline) on $(PRESET) on the CPU, with a small web sample
# served on 127.0.0.1 and small public evaluation sets made offline (flows/app/run.py).
run: setup
	$(PY) -m flows.app.run run $(FLOW_OPTIONS)

# `make <stage>`: the stage's own Prefect flow, after the stages it reads, with the pipeline's folders and cache
# keys: what `make run` did is Cached, and `make run` reuses what a stage target did. The stages are listed once,
# in tasks/runtime/names.py. Options: URL_LIST=laion.parquet (default: the sample web), INPUT=folder or fsspec URL
# of your own image files (read instead of a url list: docs/own-images.md), EVAL_DATA=folder or fsspec
# URL (s3://bucket/eval) with classification/ coco/ ade20k/ (default: the offline sets), CHECKPOINT=file or folder (eval: evaluate it instead
# of the pipeline's encoder), EVAL_TASKS="linprobe coco" (eval: these tasks only), YES=1 (start a run far beyond a CPU
# demo on a machine without a GPU without asking; docs/pipeline.md).
STAGES := $(shell $(PYTHON) -m tasks.runtime.names)
URL_LIST ?=
INPUT ?=
EVAL_DATA ?=
CHECKPOINT ?=
EVAL_TASKS ?=
YES ?=
FLOW_OPTIONS = $(CONFIG_OPTIONS) $(if $(URL_LIST),--url-list $(URL_LIST)) $(if $(INPUT),--input $(INPUT)) \
    $(if $(EVAL_DATA),--eval-data $(EVAL_DATA)) \
    $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) $(if $(EVAL_TASKS),--eval-tasks "$(EVAL_TASKS)") $(if $(YES),--yes)

$(STAGES): setup
	$(PY) -m flows.app.run $@ $(FLOW_OPTIONS)

# `make reproduce`: the experiment of docs/reproduce.md (the Prefect flow vip-reproduce): every arm on 2 seeds and 3
# held-out tasks, then the table, the plot and a verdict per finding and task (about 20 min here). FULL=1: a longer recipe (3 seeds, the
# non-private ceiling, 3,000 synthetic steps, DP B = 2,048 x 30 steps on 100k images each; not run here).
FULL ?=
reproduce: setup
	$(PY) -m flows.app.reproduce --experiment $(if $(FULL),full,default)

# `make gpu-check`: on a machine with an NVIDIA GPU, the gpu tests and the DP step's figures in one table (vip bench
# gpu-check, about 8 minutes of an H100 or H200; docs/performance.md).
gpu-check: setup
	$(PY) -m tasks.cli bench gpu-check

# `make ui`: the Prefect UI on 127.0.0.1:4200 and the MLflow UI on 127.0.0.1:5000, on the stores in $(VIP_HOME).
ui: setup
	$(PY) -m flows.app.servers ui

# `make serve`: the flows as deployments, so that a run can be started from the Prefect UI (needs `make ui` running);
# their default config is PRESET, CONFIG and SET's.
serve: setup
	$(PY) -m flows.app.serve $(CONFIG_OPTIONS)

.PHONY: $(STAGES) ui serve reproduce gpu-check

# Debian packages of the browser and PostgreSQL tests (their set-up runs this target when one is missing).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
SYSTEM_PACKAGES := chromium chromium-driver postgresql
system-deps:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null \
	    && ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then echo "system packages present"; \
	else $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q \
	    --no-install-recommends $(SYSTEM_PACKAGES); fi

.PHONY: system-deps

# Mesa's EGL and llvmpipe (headless OpenGL 4.5 on the CPU) for `vip render` and its tests: installed as root
# through apt-get only when one is missing (a GPU machine's driver may provide its own EGL as well).
GL_PACKAGES := libegl1 libgl1 libegl-mesa0 libgl1-mesa-dri
GL_SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
gl-libs:
	@if ! command -v dpkg >/dev/null || dpkg -s $(GL_PACKAGES) >/dev/null 2>&1; then :; \
	else $(GL_SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(GL_SUDO) apt-get install -y -q \
	    --no-install-recommends $(GL_PACKAGES); fi
