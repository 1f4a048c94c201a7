"""Feedback for each student that is honest and leaks nothing.

    python -m autograder.reports.feedback            # make feedback

    python -m autograder.reports.feedback --student ana --assignment 01_mha_shapes   # one submission

For every graded submission, ``autograder/course_root/feedback/<student>/<assignment>/<notebook>.html``
(nbgrader's feedback folder) lists each graded cell: what it checks (the first line of the
test cell), points earned / possible (from the gradebook, so it agrees with grades.csv), its
real state -- passed, failed, graded by hand (a written answer, or a score a grader set in
Formgrader, with that grade) or pending (waits for a hand grade; the total then says it is
incomplete) -- the comment a grader typed in Formgrader, the late penalty (the course's rule as it
stands when the page is written, :mod:`autograder.term.scores`), and, when it failed:

* the visible check failed: its message (the same the student sees when running the cell);
* only the hidden tests failed (the test raised ``HiddenTestFailure``): a sentence saying so;
* the grader skipped the cell (it stopped or hung the kernel), it timed out, or ran out of
  memory: that reason.

What happened while grading (a cell interrupted at the time limit, a kernel that crashed,
modules the notebook replaced) is said in plain words.  Formgrader's "Generate Feedback"
runs this too (autograder/formgrader/pipeline_buttons.py).  Never shown: the
code of any test cell, tracebacks, printed output, and any message that quotes a line of
the hidden tests.
"""

from __future__ import annotations

import html
import json
import sys
from pathlib import Path

import nbformat

from autograder.command_line import command_line
from autograder.places import COURSE_ROOT
from autograder.publishing.release import HIDDEN_BEGIN, HIDDEN_END, source_path
from autograder.store import gradebook, results
from autograder.term import scores
from autograder.term.course_settings import CourseSettings

MAX_MESSAGE = 1500


def hidden_lines(source: str) -> list[str]:
    """Distinctive lines of a test cell's hidden block (a message quoting one is withheld)."""
    lines = [line.strip() for line in source.splitlines()]
    if HIDDEN_BEGIN not in lines:
        return []
    begin = lines.index(HIDDEN_BEGIN)
    end = lines.index(HIDDEN_END) if HIDDEN_END in lines else len(lines)
    return [line for line in lines[begin + 1:end] if len(line) >= 8]


def explain(cell: results.GradedCell, test_source: str, timeout_hint: str = "") -> str:
    """What a student may be told about a failed test cell."""
    ename, evalue = cell.ename, cell.evalue
    if ename == results.SKIPPED_CELL:
        return f"Not run: {evalue}."
    if ename in ("CellTimeoutError", "KeyboardInterrupt"):   # the grader's interrupt at the time limit
        return f"Stopped: the test ran past the time limit{timeout_hint}. Look for an endless loop or very slow code."
    if ename == "MemoryError":
        return "Stopped: your code ran out of memory during this test."
    if cell.hidden_failure:
        return ("Your answer passed the visible check but failed the hidden tests (other random inputs, "
                "the CPU, edge cases). Test it on other shapes and values.")
    if any(line in evalue for line in hidden_lines(test_source)):
        return f"{ename} (message withheld: it quotes the grader's hidden tests)."
    message = f"{ename}: {evalue}" if evalue else str(ename)
    return message[:MAX_MESSAGE] + ("…" if len(message) > MAX_MESSAGE else "")


TIMEOUT_NOTE = ("{where} ran past the time limit and was interrupted; the tests after it ran with what the "
                "notebook had defined by then. Look for an endless loop or very slow code there.")


def test_rows(autograded: Path, source: Path, grades: dict[str, dict],
              pending: set[str] = frozenset(), comments: dict[str, str] | None = None) -> list[dict]:
    """One row per graded cell, with its real state: ``passed``, ``failed``, ``graded by hand``
    (a written answer, or a score a grader set in Formgrader) or ``pending`` (waits for a hand grade).

    ``grades``: grade_id -> {"score", "max_score", "manual_score", "auto_score"} (the gradebook's),
    or (score, max_score); ``pending``: cells still waiting for a grader; ``comments``: grade_id ->
    what a grader typed in Formgrader."""
    notebook = nbformat.read(autograded, as_version=4)
    comments = comments or {}
    sources = {}
    if source.exists():
        sources = {c.grade_id: c.source for c in results.graded_cells(nbformat.read(source, as_version=4))}
    rows = []
    for cell in results.graded_cells(notebook, autograded.stem):
        test_source = sources.get(cell.grade_id, cell.source)
        grade = grades.get(cell.grade_id, (0.0, cell.points))
        if not isinstance(grade, dict):
            grade = {"score": grade[0], "max_score": grade[1], "manual_score": None}
        score, max_score, by_hand = grade["score"], grade["max_score"], grade.get("manual_score") is not None
        row = {"grade_id": cell.grade_id, "score": score, "max_score": max_score,
               "comment": comments.get(cell.grade_id, ""), "message": ""}
        if cell.manual:
            row["checks"] = "written answer, graded by hand"
        else:
            first_line = test_source.strip().splitlines()[0] if test_source.strip() else cell.grade_id
            row["checks"] = first_line.strip().strip('"').strip("'")
        if cell.grade_id in pending:
            row.update(state="pending", score=None, message="awaiting grading by hand")
        elif cell.manual and not by_hand:   # nbgrader gives an answer left as released 0, ungraded
            row.update(state="not answered", message=f"not answered (left as released): {score:g} / {max_score:g}")
        elif cell.manual:
            row.update(state="graded by hand", message=f"graded by hand: {score:g} / {max_score:g}")
        elif by_hand:
            automatic = "passed" if cell.passed else "failed"
            row.update(state="graded by hand",
                       message=f"graded by hand: {score:g} / {max_score:g} (the automatic check {automatic})"
                       + (f"\n{explain(cell, test_source)}" if cell.error else ""))
        elif cell.passed:
            row["state"] = "passed"
        else:
            row.update(state="failed", message=explain(cell, test_source))
        row["passed"] = row["state"] == "passed"
        rows.append(row)
    return rows


def render(student: str, assignment: str, notebook: str, rows: list[dict], notes: list[str],
           other_comments: dict[str, str] | None = None, late_penalty: float = 0.0, late: str = "") -> str:
    total = sum(r["score"] or 0 for r in rows)
    possible = sum(r["max_score"] or 0 for r in rows)
    for r in rows:  # rows built elsewhere may give only "passed"
        r.setdefault("state", "passed" if r.get("passed") else "failed")
    waiting = sum(r["state"] == "pending" for r in rows)
    esc = html.escape
    title = assignment if notebook == assignment else f"{assignment}: {notebook}"
    final = max(0.0, total - late_penalty)
    score = f"<b>{final:g} / {possible:g}</b>"
    if late_penalty:
        score += f" ({total:g} minus a late penalty of {late_penalty:g})"
    if waiting:
        score += (f" <b class='incomplete'>(incomplete: {waiting} answer{'s' if waiting > 1 else ''} "
                  "still waiting for grading by hand)</b>")
    body = [f"<h1>{esc(title)}</h1>", f"<p>Student: <b>{esc(student)}</b>. Score: {score}</p>"]
    if late:
        body.append(f"<p class='late'>{esc(late)}</p>")
    if notes:
        body.append("<h2>What happened while grading</h2><ul class='incidents'>"
                    + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    body.append("<table><tr><th>test</th><th>what it checks</th><th>points</th><th>result</th>"
                "<th>grader's comment</th></tr>")
    for r in rows:
        result = "passed" if r["state"] == "passed" else esc(r["message"])
        points = "-" if r["score"] is None else f"{r['score']:g}"
        css = {"passed": "ok", "failed": "fail", "not answered": "fail", "pending": "pending"}.get(r["state"], "hand")
        body.append(f"<tr class='{css}' data-state='{esc(r['state'])}'><td><code>{esc(r['grade_id'])}</code></td>"
                    f"<td>{esc(r['checks'])}</td><td>{points} / {(r['max_score'] or 0):g}</td>"
                    f"<td class='result'>{result}</td><td class='comment'>{esc(r.get('comment', ''))}</td></tr>")
    body.append("</table>")
    if other_comments:
        body.append("<h2>Comments on your answers</h2><ul class='comments'>" + "".join(
            f"<li><code>{esc(name)}</code>: <span class='comment'>{esc(text)}</span></li>"
            for name, text in other_comments.items()) + "</ul>")
    # pre-wrap: a check's message is laid out in lines (expected / got / likely mistake)
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.4em;vertical-align:top;text-align:left}"
             "td.result,td.comment,span.comment{white-space:pre-wrap}"
             "tr.ok td.result{color:#070}tr.fail td.result{color:#a00}tr.pending td.result{color:#a60}"
             "tr.hand td.result{color:#004}.incomplete{color:#a60}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)} feedback</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def place(incident: dict, notebook: nbformat.NotebookNode | None = None) -> dict:
    """The incident with a place a student can find: a cell of no exercise (no grade id) is
    named by the heading it is under, not by a cell number Jupyter does not show."""
    if incident.get("grade_id") or notebook is None or not incident.get("cell"):
        return incident
    for cell in reversed(notebook.cells[:int(incident["cell"])]):
        if cell.cell_type == "markdown":
            heading = next((line.lstrip("#").strip() for line in cell.source.splitlines() if line.startswith("#")), "")
            if heading:
                return {**incident, "grade_id": f"the cell under “{heading}”"}
    return {**incident, "grade_id": "a cell at the top of the notebook"}


def incident_notes(incidents: list[dict], notebook: nbformat.NotebookNode | None = None) -> list[str]:
    """Each incident the student is told about, in plain words (a time limit included)."""
    notes = []
    for incident in (place(i, notebook) for i in incidents):
        if incident.get("kind") == "timeout":
            notes.append(TIMEOUT_NOTE.format(where=results.where(incident)))
        else:
            notes.append(results.describe(incident, for_student=True))
    return list(dict.fromkeys(note for note in notes if note))


def _notes(graded_dir: Path, notebook: Path | None = None) -> list[str]:
    """What the grader did to this submission, told to the student."""
    try:
        record = json.loads((graded_dir / ".grading.json").read_text())
    except (OSError, ValueError):
        return []
    executed = nbformat.read(notebook, as_version=4) if notebook is not None and notebook.exists() else None
    return incident_notes(record.get("incidents", []), executed)


def _late(score: scores.Score, penalty: float) -> str:
    """The page's sentence on lateness (``penalty``: this notebook's share), from the course's rule now."""
    if not score.late:
        return ""
    how_late = f"{scores.lateness(score.seconds_late)} " if score.seconds_late >= 60 else ""   # (a mark, no time)
    return f"Submitted {how_late}after the due date" + (f": late penalty {penalty:g} points." if penalty else ".")


def failure_in_plain_words(error: str) -> str:
    """Why the grader could not grade a submission, for the student (the log stays with the instructor)."""
    if "could not start" in error:
        return "the Python kernel could not start on the grading machine (not your fault)"
    if "notebook-timeout" in error:
        return "it ran past the time limit for the whole notebook"
    if "attempts" in error or "was skipped and the kernel still failed" in error:
        return "it stopped or hung the Python kernel again after the grader skipped the cells that did"
    return "the grader failed on it"


def write_not_graded(root: Path, students: list[str] | None = None,
                     assignments: list[str] | None = None) -> list[Path]:
    """A page for each submission the last grading run could not grade (and that has no grade):
    it says so in plain words, so a student is never left with an old page or none."""
    try:
        report = json.loads((root / "reports" / "grading_report.json").read_text())
    except (OSError, ValueError):
        return []
    written = []
    for outcome in report.get("submissions", []):
        student, assignment = outcome.get("student"), outcome.get("assignment")
        if outcome.get("status") != "failed" or (students and student not in students) or (
                assignments and assignment not in assignments):
            continue
        if (root / "autograded" / student / assignment).is_dir():
            continue  # graded earlier: its page stands, from that grade
        what = {"kernel_died": "stopped the Python kernel", "kernel_unresponsive": "hung the Python kernel",
                "notebook_timeout": "was running when the notebook reached its time limit",
                "timeout": "ran past the time limit and was interrupted"}
        notes = list(dict.fromkeys(f"{results.where(i)} {what[i['kind']]}." for i in outcome.get("incidents", [])
                                   if i.get("kind") in what))
        esc = html.escape
        body = (f"<h1>{esc(assignment)}</h1><p>Student: <b>{esc(student)}</b>.</p>"
                f"<p class='not-graded'><b>Not graded yet:</b> the grader could not grade this submission: "
                f"{esc(failure_in_plain_words(outcome.get('error', '')))}. Your instructor has been told and will "
                "look at it.</p>" + ("<ul class='incidents'>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>"
                                     if notes else ""))
        target = root / "feedback" / student / assignment / f"{assignment}.html"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(assignment)} feedback"
                          f"</title></head><body>{body}</body></html>\n", encoding="utf-8")
        written.append(target)
    return written


def write_feedback(root: Path = COURSE_ROOT, students: list[str] | None = None,
                   assignments: list[str] | None = None) -> list[Path]:
    """Feedback pages of every graded submission (or only those of ``students`` / ``assignments``)."""
    written = write_not_graded(root, students, assignments)
    if not gradebook.exists(root):
        return written
    settings = CourseSettings.load(root)
    with gradebook.exclusive(root) as gb:
        for assignment in gb.assignments:
            if assignments and assignment.name not in assignments:
                continue
            for submission in assignment.submissions:
                student = submission.student.id
                if students and student not in students:
                    continue
                graded_dir = root / "autograded" / student / assignment.name
                score = scores.submission_score(submission, settings)   # the late penalty as the rules say now
                for notebook in submission.notebooks:
                    autograded = graded_dir / f"{notebook.name}.ipynb"
                    if not autograded.exists():
                        continue
                    grades = {g.name: {"score": g.score, "max_score": g.max_score, "manual_score": g.manual_score,
                                       "auto_score": g.auto_score} for g in notebook.grades}
                    pending = {g.name for g in notebook.grades if g.needs_manual_grade}
                    comments = {c.name: c.manual_comment.strip() for c in notebook.comments
                                if c.manual_comment and c.manual_comment.strip()}
                    rows = test_rows(autograded, source_path(root, assignment.name), grades, pending, comments)
                    shown = {r["grade_id"] for r in rows}
                    others = {name: text for name, text in sorted(comments.items()) if name not in shown}
                    target = root / "feedback" / student / assignment.name / f"{notebook.name}.html"
                    target.parent.mkdir(parents=True, exist_ok=True)
                    penalty = scores.notebook_penalty(notebook, student, settings, score.seconds_late)
                    target.write_text(render(student, assignment.name, notebook.name, rows, _notes(graded_dir, autograded),
                                             others, penalty, _late(score, penalty)), encoding="utf-8")
                    written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__, course_root=True)
    parser.add_argument("--student", action="append", help="only this student (repeatable)")
    parser.add_argument("--assignment", action="append", help="only this assignment (repeatable)")
    options = parser.parse_args(argv)
    written = write_feedback(options.root, options.student, options.assignment)
    print(f"wrote {len(written)} feedback files under {options.root / 'feedback'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
