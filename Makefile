# vip: every target sets up (or refreshes) the virtual environment .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VIP := $(VENV)/bin/vip
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
# `make run`: the whole pipeline on $(PRESET) on the CPU, with a small web sample served on 127.0.0.1.
run: setup
	$(PY) -m tasks.demo --preset $(PRESET)

# `make ui`: the Prefect UI on 127.0.0.1:4200 and the MLflow UI on 127.0.0.1:5000, on the stores in $(VIP_HOME).
ui: setup
	$(PY) -m tasks.services ui

# `make serve`: the deployments, so that a run can be started from the Prefect UI (needs `make ui` running).
serve: setup
	$(PY) -m flows.serve

# Debian packages of the browser and PostgreSQL tests (their set-up runs this target when one is missing).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
SYSTEM_PACKAGES := chromium chromium-driver postgresql
system-deps:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null \
	    && ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then echo "system packages present"; \
	else $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q \
	    --no-install-recommends $(SYSTEM_PACKAGES); fi

.PHONY: ui serve system-deps

# Mesa's EGL and llvmpipe (headless OpenGL 4.5 on the CPU) for `vip render` and its tests: installed as root
# through apt-get only when one is missing (a GPU machine's driver may provide its own EGL as well).
GL_PACKAGES := libegl1 libgl1 libegl-mesa0 libgl1-mesa-dri
GL_SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
gl-libs:
	@if ! command -v dpkg >/dev/null || dpkg -s $(GL_PACKAGES) >/dev/null 2>&1; then :; \
	else $(GL_SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(GL_SUDO) apt-get install -y -q \
	    --no-install-recommends $(GL_PACKAGES); fi

# `make render`: synthetic images from the built-in shader program generator into $(VIP_HOME)/data/synthetic.
RENDER_IMAGES ?= 256
RENDER_SIZE ?= 32
render: setup
	$(VIP) render --preset $(PRESET) --out $(VIP_HOME)/data/synthetic --num-images $(RENDER_IMAGES) --size $(RENDER_SIZE)

.PHONY: gl-libs render

# `make ingest URL_LIST=laion.parquet [EVAL_IMAGES=folder]`: a LAION-format url list into clean web shards in
# $(VIP_HOME)/data/web. Without URL_LIST: the sample web of photographs (and its bad cases) served on 127.0.0.1.
URL_LIST ?=
EVAL_IMAGES ?=
INGEST_OUT ?= $(VIP_HOME)/data/web
ingest: setup
	$(if $(URL_LIST),$(VIP) ingest --preset $(PRESET) --url-list $(URL_LIST) --output $(INGEST_OUT) \
	    $(if $(EVAL_IMAGES),--eval-images $(EVAL_IMAGES)),$(PY) -m tasks.demo_web --preset $(PRESET) --output $(INGEST_OUT))

.PHONY: ingest

# `make pretrain-syn`, then `make pretrain-dp`: MAE pre-training on Ray Train (a local Ray, or the cluster in
# RAY_ADDRESS): on the synthetic shards without privacy, then with DP on the web shards, warm-started from the
# synthetic checkpoint. Re-running continues an interrupted run (ledger included) and skips a finished one.
pretrain-syn: setup
	$(VIP) pretrain --stage synthetic --preset $(PRESET) --resume

pretrain-dp: setup
	$(VIP) pretrain --stage private --preset $(PRESET) --resume

.PHONY: pretrain-syn pretrain-dp

# `make eval [CHECKPOINT=run folder or .pt/.pth] [EVAL_DATA=folder] [EVAL_TASKS="linprobe coco"]`: each downstream
# job on the checkpoint's encoder and, in the same run, on a random-init encoder of the same size (metrics.json
# in $(VIP_HOME)/runs/$(PRESET)/eval/<task>). Default checkpoint: the DP stage's; default data: the offline
# sets (digits, COCO-format and ADE20K-format shapes), made once by `vip eval-data`. `make -j` runs jobs in parallel.
CHECKPOINT ?= $(VIP_HOME)/runs/$(PRESET)/pretrain-dp
EVAL_DATA ?= $(VIP_HOME)/data/eval
EVAL_TASKS ?= linprobe finetune fewshot coco ade20k
EVAL_FOLDER_linprobe := classification
EVAL_FOLDER_finetune := classification
EVAL_FOLDER_fewshot := classification
EVAL_FOLDER_coco := coco
EVAL_FOLDER_ade20k := ade20k

eval: $(addprefix eval-,$(EVAL_TASKS))

$(EVAL_DATA)/.made: | setup
	$(VIP) eval-data --preset $(PRESET) --root $(EVAL_DATA) && touch $@

eval-%: setup $(EVAL_DATA)/.made
	$(VIP) evaluate --task $* --preset $(PRESET) --checkpoint $(CHECKPOINT) --data $(EVAL_DATA)/$(EVAL_FOLDER_$*) \
	    --output $(VIP_HOME)/runs/$(PRESET)/eval/$*

.PHONY: eval
