# Two commands on a fresh machine: `make run` (set up + run the pipeline end to end) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test up bench

setup: $(STAMP)

# torch is pinned to the CPU build via constraints.txt; GPU hosts install `.[gpu]` without it.
$(STAMP): pyproject.toml constraints.txt edge/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

run: setup
	$(BIN)/sim2edge run

up: setup
	$(BIN)/sim2edge up

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests
