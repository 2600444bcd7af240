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

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow
