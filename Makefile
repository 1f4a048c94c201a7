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

.PHONY: help setup lab release release-check test test-fast grade feedback export bench clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
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

test: setup ## run the whole test suite (sets up first if needed)
	$(BIN)/python -m pytest -n $(JOBS) --dist loadgroup

test-fast: setup ## the suite without the slow notebook/nbgrader tests
	$(BIN)/python -m pytest -n $(JOBS) -m "not slow"

grade: setup ## autograde every submission under autograder/submitted/<student>/<assignment>/
	$(BIN)/python -m autograder.grade

feedback: setup ## write feedback for every autograded submission
	$(BIN)/python -m autograder.grade --feedback

export: setup ## write autograder/grades.csv
	cd autograder && ../$(BIN)/nbgrader export --to grades.csv

bench: setup ## measure notebook run time and autograde overhead (see benchmarks/)
	$(BIN)/python -m benchmarks.notebooks
	$(BIN)/python -m benchmarks.grading

clean: ## remove generated grading folders (keeps .venv and course/)
	rm -rf autograder/source autograder/release autograder/autograded autograder/feedback autograder/gradebook.db
