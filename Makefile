# Attention Lab: the only entry point. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
JOBS ?= 2
# Jupyter refuses to run as root unless told to (CI and containers run as root).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: help setup lab release release-check test test-fast sandbox intake grade feedback export bench clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "make setup needs Python 3.11+" \
	  "(the versions pinned in constraints.txt); $(PYTHON) is $$($(PYTHON) --version 2>&1): run again with PYTHON=<a Python 3.11 or newer>"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP) ## create .venv and install the course, nbgrader and the test tools (pinned)

lab: setup ## open JupyterLab on the course (sets up first if needed)
	cd course && ../$(BIN)/jupyter lab $(ROOT_FLAG) $(LAB_ARGS)

release: setup ## regenerate the student notebooks in course/ from solutions/
	$(BIN)/python -m autograder.release

release-check: setup ## fail if course/ is stale
	$(BIN)/python -m autograder.release --check

# The oldest versions pyproject.toml allows, in a scratch venv per Python (multi-GB: torch
# from PyPI brings its CUDA libraries). FLOORS_PYTHON=python3.10 also tries the oldest Python.
FLOORS_PYTHON ?= $(PYTHON)
# The extras `make setup` installs (EXTRAS, where set, adds notebook 06's Triton on Linux).
FLOORS_EXTRAS = $(or $(EXTRAS),dev)
FLOORS_VENV ?= .venv-floors-$(shell $(FLOORS_PYTHON) -c 'import sys; print(*sys.version_info[:2], sep=".")')

$(FLOORS_VENV)/.installed: pyproject.toml
	$(FLOORS_PYTHON) -m venv --clear $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m benchmarks.floors constraints > $(FLOORS_VENV)/floors.txt
	$(FLOORS_VENV)/bin/python -m pip install --quiet -c $(FLOORS_VENV)/floors.txt -e ".[$(FLOORS_EXTRAS)]"
	touch $@

.PHONY: floors
floors: setup $(FLOORS_VENV)/.installed ## run the notebooks and check tests on the lowest supported versions (slow)
	$(FLOORS_VENV)/bin/python -m benchmarks.floors run

sandbox: ## install bubblewrap (isolates student code while grading) when it is missing
	@command -v bwrap >/dev/null || { (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
	  || echo "warning: could not install bubblewrap; grading will run WITHOUT isolation"; }

test: setup sandbox ## run the whole test suite (sets up first if needed)
	$(BIN)/python -m pytest -n $(JOBS) --dist loadgroup

test-fast: setup ## the suite without the slow notebook/nbgrader tests
	$(BIN)/python -m pytest -n $(JOBS) -m "not slow"

intake: setup ## file SUBMISSIONS=<dir> (<student>/<file>) under autograder/submitted/, with a report
	@test -n "$(SUBMISSIONS)" || { echo "usage: make intake SUBMISSIONS=<folder>"; exit 2; }
	$(BIN)/python -m autograder.intake "$(SUBMISSIONS)"

grade: setup sandbox ## autograde new/changed submissions, JOBS students at a time (FORCE=1 regrades all)
	$(BIN)/python -m autograder.grade --jobs $(JOBS) $(if $(FORCE),--force)

feedback: setup ## write autograder/feedback/<student>/<assignment>/*.html
	$(BIN)/python -m autograder.feedback

export: setup ## write autograder/grades.csv and autograder/grades_by_question.csv
	$(BIN)/python -m autograder.export

bench: setup ## measure notebook run time and autograde overhead (see benchmarks/)
	$(BIN)/python -m benchmarks.notebooks
	$(BIN)/python -m benchmarks.grading

clean: ## remove generated grading folders (keeps .venv, course/ and submissions)
	rm -rf autograder/source autograder/release autograder/autograded autograder/feedback autograder/gradebook.db \
	  autograder/.grading autograder/reports autograder/grades.csv autograder/grades_by_question.csv
