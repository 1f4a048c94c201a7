# Attention Lab: the only entry point. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
JOBS ?= 2
# Test processes: one more than the cores of a 2-core machine. A third of the suite is waiting
# (servers starting, browsers, kernels past their time limits); a third process fills that
# time (on 2 cores: CPU 90% busy and 597 s, against 64% and 700 s with two).
TEST_JOBS ?= 3
# A shared gradebook on a database server (`make grade DB_URL=postgresql://...`): every target
# that opens the gradebook (grade, feedback, export, formgrader) uses it; SQLite otherwise.
ifdef DB_URL
export ATTENTION_LAB_DB_URL := $(DB_URL)
endif
# Python keeps compiled modules (__pycache__/, git-ignored) even where the environment says not to:
# every kernel, checker and nbgrader process imports the course package, and compiling it again in
# each one cost about 5 % of the test suite's CPU time.
unexport PYTHONDONTWRITEBYTECODE
# Jupyter refuses to run as root unless told to (CI and containers run as root).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: help setup lab formgrader release release-check test test-fast sandbox browser postgres intake grade feedback export bench gpu-check clean
.PHONY: roster deadlines withdraw report settings extension example-class publish lms-export dask-scheduler dask-worker erase-course-root postgres-server postgres-stop migrate-gradebook

# The late penalty, grace period, extensions and limits are course settings, kept in the course
# root by `make settings` and read by every grading path: a flag of one `make grade` would
# vanish at the next run (or at Formgrader's Autograde).
ifneq ($(filter grade,$(MAKECMDGOALS)),)
ifdef LATE_PENALTY
$(error LATE_PENALTY is a course setting, not a flag of one run: `make settings LATE_PENALTY=$(LATE_PENALTY)` keeps it for every grading run (Formgrader's Autograde included), then `make grade`)
endif
endif

# `make help`: an instructor's targets in the order of a term, then everyone else's.
TERM_ORDER := setup example-class release roster deadlines settings extension intake withdraw grade formgrader feedback export \
  lms-export report publish clean erase-course-root postgres-server migrate-gradebook postgres-stop dask-scheduler dask-worker
HELP_LINE := awk -F':.*\#\# ' '{printf "  make %-18s %s\n", $$1, $$2}'
help: ## list the targets
	@echo "A term, in order (each target's variables after it):"
	@for target in $(TERM_ORDER); do grep -hE "^$$target:.*## " $(MAKEFILE_LIST) | $(HELP_LINE); done
	@echo "Students, contributors, the machine:"
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | grep -vE "^($(subst $(eval) ,|,$(strip $(TERM_ORDER)))):" | $(HELP_LINE)

# Triton (notebook 06's kernel) publishes wheels for Linux only.
COMMA := ,
EXTRAS := dev$(if $(filter Linux,$(shell uname -s)),$(COMMA)triton)

# Files in chunks of 64 (compileall's own workers take one file per round trip: 24 s on 2 cores,
# against 15 s), skipping the installed packages' test folders and pip, which nothing imports.
COMPILE_BYTECODE := import compileall, functools, multiprocessing, os, re, sysconfig; \
  skip = re.compile(r"/tests?/|/site-packages/pip/"); \
  files = [path for folder, _, names in os.walk(sysconfig.get_paths()["purelib"]) for name in names \
           if name.endswith(".py") and not skip.search(path := os.path.join(folder, name))]; \
  multiprocessing.Pool().map(functools.partial(compileall.compile_file, quiet=2), files, chunksize=64)

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "make setup needs Python 3.11+" \
	  "(the versions pinned in constraints.txt); $(PYTHON) is $$($(PYTHON) --version 2>&1): run again with PYTHON=<a Python 3.11 or newer>"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e ".[$(EXTRAS)]"
	@# The bytecode of what was installed, on every core (pip compiles one file at a time: 34 s on
	@# 2 cores). A file that is not Python 3.11 (a torch test helper) is skipped, as pip skips it.
	$(BIN)/python -c '$(COMPILE_BYTECODE)'
	touch $(STAMP)

setup: $(STAMP) ## create .venv and install the course, nbgrader and the test tools (pinned)

lab: setup ## students: JupyterLab on course/ with Validate (sets up first if needed)
	cd course && JUPYTER_CONFIG_PATH=$(CURDIR)/autograder/lab/student ../$(BIN)/jupyter lab $(ROOT_FLAG) $(LAB_ARGS)

# The course root Formgrader serves: nbgrader_config.py names it; a test serves a scratch root
# holding an nbgrader_config.py of its own (nbgrader reads the working folder's config last).
FORMGRADER_ROOT ?= $(or $(ATTENTION_LAB_COURSE_ROOT),autograder/course_root)
# .venv/bin on PATH: nbgrader runs the `alembic` executable when it opens the gradebook.
# INSTRUCTOR_KERNELS=on: terminals and kernels in this lab (they run as you, unsandboxed); off by default.
INSTRUCTOR_KERNELS ?=
formgrader: setup ## JupyterLab with nbgrader's Formgrader on the course root, for you and your TAs (FORMGRADER_ARGS=<JupyterLab options>, DB_URL=, INSTRUCTOR_KERNELS=on)
	mkdir -p $(FORMGRADER_ROOT)
	$(BIN)/python -m autograder.store.gradebook --root "$(FORMGRADER_ROOT)" check
	@# a gradebook on a server: the one the course root remembers (its password from ~/.pgpass) or DB_URL's
	gradebook=$$($(BIN)/python -m autograder.store.gradebook --root "$(FORMGRADER_ROOT)" url) && cd $(FORMGRADER_ROOT) && \
	  ATTENTION_LAB_DB_URL="$$gradebook" PATH=$(CURDIR)/$(BIN):$$PATH ATTENTION_LAB_INSTRUCTOR_KERNELS=$(INSTRUCTOR_KERNELS) \
	  JUPYTER_CONFIG_PATH=$(CURDIR)/autograder/formgrader:$(CURDIR)/autograder \
	  $(CURDIR)/$(BIN)/jupyter lab $(ROOT_FLAG) $(FORMGRADER_ARGS)

release: setup ## regenerate the student notebooks in course/ from solutions/
	$(BIN)/python -m autograder.publishing.release

release-check: setup ## fail if course/ is stale
	$(BIN)/python -m autograder.publishing.release --check

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

# SANDBOX=off: grade WITHOUT isolating student code (trusted submissions only); by default
# `make grade` refuses to grade where bubblewrap cannot run, and says why. Grading installs
# nothing: `make sandbox` (or `make test`) installs bubblewrap.
SANDBOX ?= on

sandbox: ## install bubblewrap (isolates student code while grading) when it is missing
	@command -v bwrap >/dev/null || { (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
	  || echo "warning: could not install bubblewrap; make grade will refuse to grade (SANDBOX=off grades WITHOUT isolation)"; }

browser: ## install Debian's chromium (the browser tests drive it with Playwright) when it is missing
	@test -x /usr/bin/chromium || { (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
	  || echo "warning: could not install chromium; the browser tests will be SKIPPED"; }

postgres: ## install Debian's PostgreSQL server (the shared-gradebook tests start one) when it is missing
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { (apt-get update -qq && apt-get install -y -qq postgresql) >/dev/null 2>&1 \
	  || echo "warning: could not install postgresql; the PostgreSQL gradebook tests will be SKIPPED"; }

# The shared gradebook's server (docs/instructors/6-grading-at-scale.md): data in PGDATA, on PGPORT.
PGDATA ?= $(HOME)/attention-lab-postgres
PGPORT ?= 5432
postgres-server: setup ## start (created on first use) a PostgreSQL server for the gradebook: PGDATA= PGPORT=; prints DB_URL (the password goes to ~/.pgpass, never on screen)
	@# (DB_PASSWORD=, when given, reaches it through the environment, never on a command line `ps` shows)
	$(BIN)/python -m autograder.store.postgres start --data "$(PGDATA)" --port "$(PGPORT)"

postgres-stop: setup ## stop the server of PGDATA=
	$(BIN)/python -m autograder.store.postgres stop --data "$(PGDATA)"

migrate-gradebook: setup ## move the course's SQLite gradebook (grades, hand grades, comments, students, due dates) to DB_URL=postgresql://...
	@test -n "$(DB_URL)" || { echo "usage: make migrate-gradebook DB_URL=postgresql://grader:<password>@<host>:5432/attention_lab"; exit 2; }
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m autograder.store.gradebook migrate --to "$(DB_URL)"

test: setup sandbox browser postgres ## run the whole test suite (sets up first if needed)
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadgroup

test-fast: setup ## the suite without the slow notebook/nbgrader tests
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadgroup -m "not slow"

example-class: setup ## a dry run: write example-class/ (a roster, deadlines and a Canvas export of four students; see docs/instructors/2-dry-run.md)
	$(BIN)/python -m autograder.term.example_class

intake: setup ## file SUBMISSIONS=<zip or folder> (an LMS's download as it comes, or <student>/<file>) under the course root's submitted/, with a report (ADD_UNKNOWN=1: accept students not on the roster)
	@test -n "$(SUBMISSIONS)" || { echo "usage: make intake SUBMISSIONS=<folder or .zip>"; exit 2; }
	$(BIN)/python -m autograder.term.intake "$(SUBMISSIONS)" $(if $(ADD_UNKNOWN),--add-unknown)

roster: setup ## import ROSTER=<csv> (id,first_name,last_name,email,lms_user_id): intake checks names against it
	@test -n "$(ROSTER)" || { echo "usage: make roster ROSTER=<csv>"; exit 2; }
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m autograder.term.roster import "$(ROSTER)"

DEADLINES ?= deadlines.csv
deadlines: setup ## set each assignment's due date in the gradebook from DEADLINES=<csv> (assignment,duedate)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m autograder.term.roster deadlines "$(DEADLINES)"

withdraw: setup ## take out one wrongly filed submission: STUDENT=<id> ASSIGNMENT=<name> (archived, not deleted)
	@test -n "$(STUDENT)" -a -n "$(ASSIGNMENT)" || { echo "usage: make withdraw STUDENT=<id> ASSIGNMENT=<name>"; exit 2; }
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m autograder.term.roster withdraw --student "$(STUDENT)" --assignment "$(ASSIGNMENT)"

# Each variable given is set; none given shows the settings.
SETTING_VARIABLES := LATE_PENALTY GRACE_MINUTES TIMEOUT STARTUP_TIMEOUT MEMORY_MB FILE_MB TIME_ZONE
SETTING_VALUES = $(foreach v,$(SETTING_VARIABLES),$(if $($(v)),"$(shell echo $(v) | tr A-Z a-z)=$($(v))"))
settings: setup ## show the course settings, or set them: LATE_PENALTY=none|zero GRACE_MINUTES= TIME_ZONE= TIMEOUT= STARTUP_TIMEOUT= MEMORY_MB= FILE_MB=
	$(BIN)/python -m autograder.term.course_settings $(if $(strip $(SETTING_VALUES)),set $(SETTING_VALUES))

extension: setup ## a due date of its own for one student: STUDENT=<id> ASSIGNMENT=<name> UNTIL=<ISO date> (REMOVE=1 takes it back)
	@test -n "$(STUDENT)" -a -n "$(ASSIGNMENT)" -a -n "$(UNTIL)$(REMOVE)" || { echo "usage: make extension STUDENT=<id> ASSIGNMENT=<name> UNTIL=<ISO date> (or REMOVE=1)"; exit 2; }
	$(BIN)/python -m autograder.term.course_settings extend --student "$(STUDENT)" --assignment "$(ASSIGNMENT)" \
	  $(if $(REMOVE),--remove,--until "$(UNTIL)")

# SCHEDULER=tcp://host:8786: grade on that Dask cluster (default: JOBS local worker processes);
# DB_URL=postgresql://...: the shared gradebook; STUDENT=... ASSIGNMENT=...: regrade that one submission.
grade: setup ## autograde new/changed submissions on Dask, JOBS at a time (FORCE=1, STUDENT=/ASSIGNMENT=, SCHEDULER=, DB_URL=, SANDBOX=off)
	$(BIN)/python -m autograder.grading.grade --jobs $(JOBS) --sandbox "$(SANDBOX)" $(if $(FORCE),--force) \
	  $(if $(SCHEDULER),--scheduler "$(SCHEDULER)") $(if $(STUDENT),--student "$(STUDENT)") \
	  $(if $(ASSIGNMENT),--assignment "$(ASSIGNMENT)")

# A Dask cluster of other machines (docs/instructors/6-grading-at-scale.md): run from each machine's clone,
# which these put on PYTHONPATH (the scheduler, too, unpickles the course's tasks).
DASK_PORT ?= 8786
WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
dask-scheduler: setup ## a Dask scheduler for SCHEDULER= on port DASK_PORT (8786; its dashboard on the next port)
	PYTHONPATH=$(CURDIR) $(BIN)/dask scheduler --port $(DASK_PORT) --dashboard-address :$(shell echo $$(($(DASK_PORT) + 1)))

dask-worker: setup ## WORKERS grading workers (default: one per core) for the cluster at SCHEDULER=tcp://host:8786
	@test -n "$(SCHEDULER)" || { echo "usage: make dask-worker SCHEDULER=tcp://<scheduler-host>:8786 [WORKERS=8]"; exit 2; }
	@$(BIN)/python -m autograder.grading.dask_cluster "$(SCHEDULER)"
	PYTHONPATH=$(CURDIR) $(BIN)/dask worker "$(SCHEDULER)" --nworkers $(WORKERS) --nthreads 1 --memory-limit 0

feedback: setup ## write autograder/course_root/feedback/<student>/<assignment>/*.html
	$(BIN)/python -m autograder.reports.feedback

export: setup ## write grades.csv and grades_by_question.csv in autograder/course_root/
	$(BIN)/python -m autograder.reports.export

lms-export: setup ## grades for your LMS's import (Canvas, Moodle: a row per student, a column per assigned notebook) and the feedback zips (Canvas's Re-upload submissions, Moodle's), in the course root's lms/
	$(BIN)/python -m autograder.reports.lms_export

report: setup ## the class report per assignment: autograder/course_root/reports/class/<assignment>/index.html
	$(BIN)/python -m autograder.reports.class_report

publish: setup ## write the students' repository to DEST=<folder> for REPO=<owner/name> (BRANCH=, default main): notebooks, helper package, their `make lab`, README; no solution, no hidden test
	@test -n "$(DEST)" -a -n "$(REPO)" || { echo "usage: make publish DEST=../attention-lab-students REPO=<github owner>/<students' repository> [BRANCH=main]"; exit 2; }
	$(BIN)/python -m autograder.publishing.publish --dest "$(DEST)" --repository "$(REPO)" $(if $(BRANCH),--branch "$(BRANCH)")

bench: setup ## measure notebook run time, autograde overhead, the trust boundary, attention kernels, kernel shutdown (benchmarks/)
	$(BIN)/python -m benchmarks.notebooks
	$(BIN)/python -m benchmarks.grading
	$(BIN)/python -m benchmarks.attention_kernels
	$(BIN)/python -m benchmarks.kernel_shutdown
	$(BIN)/python -m benchmarks.bridge

# A GPU machine whose Python already holds a CUDA build of torch and the course's other packages (a
# cloud GPU image, maybe offline): GPU_PYTHON=python3 runs the check with that Python, without setup.
GPU_PYTHON ?=
gpu-check: $(if $(GPU_PYTHON),,setup) ## on a CUDA GPU: run every solution notebook, the check tests and the Triton kernel natively; report (GPU_PYTHON=<a Python with CUDA torch>: no setup)
	$(if $(GPU_PYTHON),PYTHONPATH=$(CURDIR)/course$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON),$(BIN)/python) -m benchmarks.gpu_check

clean: setup ## remove what make grade/feedback/export/report rebuild (keeps the gradebook, roster, submissions, archive, reports, and what a running Formgrader needs)
	$(BIN)/python -m autograder.term.housekeeping clean

erase-course-root: setup ## delete the whole course root (gradebook, roster, submissions, archive): asks you to type "erase"
	$(BIN)/python -m autograder.term.housekeeping erase
