# `make test` and `make quickstart` work on a fresh machine: they create .venv/ if it is missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test quickstart setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py requirements/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/cpu.txt
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

test: setup
	$(PY) -m pytest -q

quickstart: setup
	PATH=$(abspath $(VENV))/bin:$$PATH bash examples/quickstart.sh

clean:
	rm -rf $(VENV) build *.egg-info
