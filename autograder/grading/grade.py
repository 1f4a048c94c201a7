"""Autograde every submission with nbgrader (the engine of record), students in parallel on Dask.

    python -m autograder.grading.grade                 # grade new or changed submissions (make grade)
    python -m autograder.grading.grade --jobs 4        # four students at a time (make grade JOBS=4)
    python -m autograder.grading.grade --force         # regrade everything
    python -m autograder.grading.grade --student "Ana Núñez" --assignment 01_mha_shapes   # one regrade
    python -m autograder.grading.grade --scheduler tcp://host:8786     # on an existing Dask cluster
    python -m autograder.grading.grade --db-url postgresql://...       # a shared gradebook on a server

Layout, in the course root ``autograder/course_root/``: ``submitted/<student>/<assignment>/
<notebook>.ipynb`` (``make intake`` puts them there, with nbgrader's ``timestamp.txt``);
``source/<assignment>/`` (built here from ``solutions/``).

How one run works (the parts live in :mod:`autograder.grading`, one module each):

1. **plan** (here): the course settings (``course_settings.json`` in the course root, ``make
   settings``: late penalty, grace period, extensions, limits) are read; every assignment is
   in the gradebook (``nbgrader generate_assignment``); each submission whose fingerprint (its
   files and submission time, the source notebook, the limits) changed since it was last
   graded becomes a task.
2. **engine**: the tasks run on Dask, an embedded ``LocalCluster`` of ``--jobs`` worker
   processes by default, or the cluster at ``--scheduler``.  A task carries bytes (the
   source, the student's files, a template gradebook, the run's limits); on the worker
   (**task**) a long-lived nbgrader process autogrades it in a temporary course root, each
   notebook in a new sandboxed kernel (:mod:`autograder.isolation.sandbox`), and returns the autograded
   notebooks and grades.  A worker that dies mid-task: Dask gives the task to another.
3. **merge**: as each task finishes, **this process alone** writes its grades into the
   gradebook (keeping hand grades of answers that did not change) and its notebooks into
   ``autograded/``: one writer, so the gradebook stays consistent.
4. **rescore**: every other submission of the run gets its late penalty again under the
   course settings and due dates (a changed penalty re-scores; nothing is re-executed).
5. **report**: the console and ``reports/grading_report.{md,json}`` say what happened to
   each submission (incidents, tampering, a kernel that could not start), and mark scores
   still awaiting hand grading.

Time limits: a cell's limit counts from that cell's start; starting the kernel and the
generated setup cell (imports) share a start-up budget of their own; an interrupted kernel
gets a grace time that grows with the cell limit.  So a loaded machine makes grading
slower, never wrong: a slow but working cell is not mistaken for a hung one.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autograder.command_line import command_line
from autograder.grading import dask_cluster
from autograder.grading.merge import ensure_assignments, ensure_sources, merge, rescore, template
from autograder.grading.plan import (IGNORED_NAMES, STATE_DIR, Outcome, Submission, discover, exclusive, fingerprint,
                                     load_state, notebook_names, save_state, submitted_folders, tree_files)
from autograder.grading.run_report import console_line, full_error, limit_lines, limits_in_force, summary, write_report
from autograder.grading.task import NbgraderProcess, start_failure_cause, tampering_incidents
from autograder.isolation import sandbox
from autograder.limits import Limits
from autograder.places import COURSE_ROOT, COURSE_SETTINGS_FILE, DB_URL_VARIABLE, TIMESTAMP_FILE
from autograder.publishing import release
from autograder.publishing.release import assignments_with_source
from autograder.store import gradebook
from autograder.store.run_reports import REPORTS_DIR
from autograder.term.course_settings import CourseSettings

__all__ = ["IGNORED_NAMES", "REPORTS_DIR", "STATE_DIR", "Limits", "NbgraderProcess", "Outcome", "Submission",
           "assignments_with_source", "discover", "ensure_assignments", "ensure_sources", "fingerprint", "grade",
           "SandboxUnavailable", "load_state", "main", "merge", "notebook_names", "save_state", "start_failure_cause",
           "tampering_incidents", "write_report"]


class SandboxUnavailable(Exception):
    """Grading refused: the sandbox cannot run here and the instructor did not turn it off."""


def _isolation(limits: Limits, log) -> str:
    """This machine's isolation (the embedded cluster's workers run here); refuses to grade
    without it unless the limits turn it off (``make grade SANDBOX=off``)."""
    if not limits.sandboxed:
        log("WARNING: the sandbox is off (SANDBOX=off): student code runs WITHOUT filesystem and network "
            "isolation, as your user. Grade only trusted submissions this way.")
        return "none: the sandbox was turned off (--sandbox off)"
    if sandbox.bwrap_path() is None:
        raise SandboxUnavailable(sandbox.refusal())
    return f"bubblewrap ({sandbox.bwrap_path()})"


def _outcome(submission: Submission, result: dict | None, error: str) -> Outcome:
    if result is None:
        return Outcome(submission.student, submission.assignment, "failed", error=error)
    data = dict(result["outcome"])
    data.pop("isolation", None)
    return Outcome(submission.student, submission.assignment, **data)


def grade(root: Path = COURSE_ROOT, *, jobs: int = 2, force: bool = False, limits: Limits | None = None,
          students: list[str] | None = None, assignments: list[str] | None = None, log=print,
          scheduler: str | None = None, db_url: str | None = None, processes: bool = True) -> list[Outcome]:
    """Grade every new or changed submission under ``root``; return one outcome per submission.

    ``limits``: the limits of this run (default: the course settings of ``root``, which
    also give the late penalty, grace period and extensions); ``scheduler``: an existing Dask
    cluster (else an embedded one with ``jobs`` worker processes, or threads when
    ``processes`` is False, and no more than there are submissions to grade); ``db_url``: the
    gradebook (else ``$ATTENTION_LAB_DB_URL``, else SQLite in ``root``).
    """
    root = Path(root).resolve()
    policy = CourseSettings.load(root)
    limits = limits or policy.limits()
    url = gradebook.db_url(root, db_url)
    isolation = _isolation(limits, log) if not scheduler else f"as each worker of {scheduler} provides"
    in_force = limits_in_force(limits) if not scheduler else []
    for line in limit_lines(in_force):
        log(line)
    with exclusive(root):
        state = load_state(root)
        submissions, problems = discover(root, students, assignments)
        for problem in problems:
            log(f"skipped: {problem}")
        # every assignment, graded or not, so that Formgrader lists them all
        ensure_assignments(root, assignments_with_source(root), state, url)
        save_state(root, state)
        todo, outcomes = _changed(submissions, root, state, limits, force)
        _rescore(outcomes, root, policy, url)
        log(f"{len(todo)} to grade, {len(outcomes)} unchanged")
        engine = ""
        if todo:
            run = Run(root, url, policy, limits, state, log)
            engine = run.on_dask(todo, max(1, jobs), scheduler, processes, outcomes)
        outcomes.sort(key=lambda o: (o.student, o.assignment))
        for unchanged in (o for o in outcomes if o.status == "unchanged"):
            log(console_line(unchanged))
        report = write_report(root, outcomes, problems, limits, isolation, engine, policy, in_force)
        log(f"report: {report}")
    return outcomes


def _changed(submissions: list[Submission], root: Path, state: dict, limits: Limits,
             force: bool) -> tuple[list[tuple[Submission, str]], list[Outcome]]:
    """The submissions to grade, each with its fingerprint (changed since it was graded, or all with
    ``force``), and an ``unchanged`` outcome for each of the others."""
    todo, unchanged = [], []
    for submission in submissions:
        digest = fingerprint(submission, root, limits)
        previous = state.get(submission.key, {})
        graded_folder = root / "autograded" / submission.student / submission.assignment
        if not force and previous.get("fingerprint") == digest and graded_folder.is_dir():
            unchanged.append(Outcome(submission.student, submission.assignment, "unchanged", fingerprint=digest))
        else:
            todo.append((submission, digest))
    return todo, unchanged


def _rescore(unchanged: list[Outcome], root: Path, policy: CourseSettings, url: str) -> None:
    """An unchanged submission's late penalty under today's settings and due dates, and what the
    gradebook holds now (hand grades included)."""
    totals = rescore(root, [(o.student, o.assignment) for o in unchanged], policy, url)
    for outcome in unchanged:
        found = totals.get((outcome.student, outcome.assignment))
        if found:
            (outcome.score, outcome.max_score, outcome.pending, outcome.late_penalty), before = found
            if before != outcome.late_penalty:
                outcome.notes.append(f"re-scored: late penalty {before:g} -> {outcome.late_penalty:g}")


@dataclass
class Run:
    """One grading run's parent side while its tasks run: where each result goes."""
    root: Path
    url: str                    # the gradebook
    policy: CourseSettings
    limits: Limits
    state: dict                 # each graded submission's fingerprint (plan.save_state)
    log: Callable[[str], object]

    def on_dask(self, todo: list[tuple[Submission, str]], jobs: int, scheduler: str | None, processes: bool,
                outcomes: list[Outcome]) -> str:
        """Grade ``todo`` on Dask, merging each result as it comes (its outcome joins ``outcomes``);
        the engine, described."""
        shared = {a: {"source": tree_files(self.root / "source" / a), "template": template(self.root, a, self.url)}
                  for a in sorted({s.assignment for s, _ in todo})}
        carried = IGNORED_NAMES - {TIMESTAMP_FILE}  # the submission time goes with the files
        tasks = [{"student": s.student, "assignment": s.assignment, "files": tree_files(s.folder, carried),
                  "limits": self.limits, "hide": [str(self.root)]} for s, _ in todo]
        # an embedded cluster starts no more workers than there are submissions to grade; one
        # gradebook session for every merge of the run (one per student cost more than the merge)
        with dask_cluster.cluster(min(jobs, len(tasks)), scheduler, processes) as connection, \
                gradebook.open_gradebook(self.root, self.url) as book:
            self.log(f"engine: {connection.description}")
            for index, result, error in dask_cluster.run(connection, shared, tasks):
                outcome = self.merged(*todo[index], result, error, book)
                outcomes.append(outcome)
                self.log(console_line(outcome))
                if outcome.error:
                    self.log(full_error(outcome))
            return connection.description

    def merged(self, submission: Submission, digest: str, result: dict | None, error: str, book) -> Outcome:
        """A task's result in the gradebook (this process is its only writer) and the run's state."""
        outcome = _outcome(submission, result, error)
        outcome.fingerprint = digest
        if outcome.status == "graded":
            try:
                merge(outcome, result, self.root, book, self.url, self.policy)
            except Exception as failure:
                outcome.status = "failed"
                outcome.error = f"merge failed: {type(failure).__name__}: {failure}"
        if outcome.status == "graded":
            self.state[submission.key] = {"fingerprint": digest, "score": outcome.score, "max_score": outcome.max_score,
                                          "graded": datetime.datetime.now().isoformat(timespec="seconds")}
        else:
            self.state.pop(submission.key, None)
        save_state(self.root, self.state)
        return outcome


NOTHING_SUBMITTED = ("nothing to grade: no submissions in {submitted}.\n"
                     "First file the students' notebooks: make intake SUBMISSIONS=<folder of <student>/<notebook>.ipynb>"
                     " (see docs/instructors/3-grading.md), then run make grade again.")


def main(argv: list[str] | None = None) -> int:
    options = _command_line().parse_args(argv)
    jobs = max(1, options.jobs)
    root = options.root
    # Before any intake there is nothing to grade: say what to do first, quickly.
    present = {(p.parent.name, p.name) for p in submitted_folders(root)}
    refusal = _nothing_to_grade(root, present, options.student, options.assignment)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    one_regrade = bool(options.student and options.assignment and len(options.student) == 1
                       and len(options.assignment) == 1)
    limits = _limits(options, root, jobs)
    gradebook.db_url(root, options.db_url)   # a gradebook this course does not use is refused before any work
    try:
        if not options.scheduler:  # refuse before building anything (grade() checks again)
            _isolation(limits, log=lambda *_: None)
        # The instructor's course root holds the whole course (Formgrader lists every assignment);
        # any other root (a test, a benchmark) only what was submitted to it.
        whole_course = root.resolve() == COURSE_ROOT.resolve()
        ensure_sources(root, release.assignment_names() if whole_course else sorted({a for _, a in present}))
        outcomes = grade(root, jobs=1 if one_regrade else jobs, force=options.force or one_regrade, limits=limits,
                         students=options.student, assignments=options.assignment, scheduler=options.scheduler,
                         db_url=options.db_url)
    except SandboxUnavailable as refusal:
        print(refusal, file=sys.stderr)
        return 2
    failed = [o for o in outcomes if o.status == "failed"]
    print(summary(outcomes))
    if failed:
        print("could not grade: " + ", ".join(f"{o.student}/{o.assignment}" for o in failed)
              + f" (see {root / REPORTS_DIR / 'grading_report.md'})")
    return 1 if failed else 0


def _command_line():
    parser = command_line(__doc__, course_root=True)
    parser.add_argument("--jobs", "-j", type=int, default=int(os.environ.get("JOBS", 2)),
                        help="students graded at once: worker processes of the embedded Dask cluster (default: $JOBS or 2)")
    parser.add_argument("--scheduler", default=None,
                        help="an existing Dask scheduler, e.g. tcp://host:8786 (make grade SCHEDULER=...; default: "
                             "an embedded cluster of --jobs worker processes)")
    parser.add_argument("--db-url", default=None,
                        help=f"the gradebook's database (default: ${DB_URL_VARIABLE}, else SQLite in the course root)")
    parser.add_argument("--force", action="store_true", help="regrade unchanged submissions too")
    parser.add_argument("--student", action="append", help="only this student (repeatable)")
    parser.add_argument("--assignment", action="append", help="only this assignment (repeatable); with one "
                        "--student: regrade that one submission, changed or not")
    defaults = Limits()
    # the course's limits, late penalty, grace period and extensions are course settings
    # (`make settings`, read from the course root by every grading path); these four flags
    # override a limit for this one run only
    this_run = "for this run only (default: the course setting, see `make settings`)"
    parser.add_argument("--timeout", type=int, default=None, help=f"seconds per cell, from its start, {this_run}")
    parser.add_argument("--startup-timeout", type=int, default=None,
                        help=f"seconds to start a kernel and run the setup cell, {this_run}")
    parser.add_argument("--memory-mb", type=int, default=None, help=f"memory limit per kernel, {this_run}")
    parser.add_argument("--file-mb", type=int, default=None, help=f"largest file a kernel may write, {this_run}")
    parser.add_argument("--notebook-timeout", type=int, default=defaults.notebook_timeout,
                        help="seconds per attempt at a whole submission")
    parser.add_argument("--submission-timeout", type=int, default=defaults.submission_timeout,
                        help="seconds for a whole submission, all its attempts together")
    parser.add_argument("--cpu-seconds", type=int, default=defaults.cpu_seconds,
                        help="CPU seconds of a submission's sandbox, all its attempts together (where a "
                             "control group measures it)")
    parser.add_argument("--disk-mb", type=int, default=defaults.disk_mb,
                        help="what a kernel may write: its /tmp and /dev/shm (each), and its folders on this disk")
    parser.add_argument("--processes", type=int, default=defaults.processes,
                        help="processes and threads in a sandbox at once (where a control group holds it)")
    parser.add_argument("--max-output-bytes", type=int, default=defaults.max_output_bytes)
    parser.add_argument("--attempts", type=int, default=defaults.attempts)
    parser.add_argument("--sandbox", choices=("on", "off"), default="on",
                        help="bubblewrap isolation: on (refuse to grade where it cannot run), or off (student "
                             "code runs unisolated: make grade SANDBOX=off)")
    return parser


def _nothing_to_grade(root: Path, present: set[tuple[str, str]], students: list[str] | None,
                      assignments: list[str] | None) -> str | None:
    """What to say when there is nothing to grade (before any intake; no submission of whom the
    run asks for), else None."""
    if not present:
        return NOTHING_SUBMITTED.format(submitted=root / "submitted")
    wanted = [(s, a) for s, a in present if (not students or s in students) and (not assignments or a in assignments)]
    if wanted:
        return None
    asked = " / ".join(filter(None, [", ".join(students or []), ", ".join(assignments or [])]))
    names = sorted({s for s, _ in present})
    return (f"nothing to grade: no submission of {asked} in {root / 'submitted'}.\n"
            f"Students with submissions: {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}")


def _limits(options, root: Path, jobs: int) -> Limits:
    """The run's limits: the course settings', with this run's flags over them (saying so)."""
    limits = CourseSettings.load(root).limits(notebook_timeout=options.notebook_timeout,
                                              submission_timeout=options.submission_timeout,
                                              cpu_seconds=options.cpu_seconds, disk_mb=options.disk_mb,
                                              processes=options.processes, max_output_bytes=options.max_output_bytes,
                                              attempts=options.attempts, sandbox=options.sandbox,
                                              threads=max(1, (os.cpu_count() or 1) // jobs))
    for name in ("timeout", "startup_timeout", "memory_mb", "file_mb"):
        if getattr(options, name) is not None and getattr(options, name) != getattr(limits, name):
            print(f"{name} {getattr(options, name)} for this run only (the course setting, {root / COURSE_SETTINGS_FILE}: "
                  f"{getattr(limits, name)}; `make settings` changes it)")
            setattr(limits, name, getattr(options, name))
    return limits


if __name__ == "__main__":
    sys.exit(main())
