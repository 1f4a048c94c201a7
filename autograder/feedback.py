"""Feedback for each student that is honest and leaks nothing.

    python -m autograder.feedback            # make feedback

For every graded submission, ``autograder/course_root/feedback/<student>/<assignment>/<notebook>.html``
(nbgrader's feedback folder, so ``nbgrader release_feedback`` still works) lists each graded
cell: what it checks (the first line of the test cell), points earned / possible (from the
gradebook, so it agrees with grades.csv) and, when it failed:

* the visible check failed: its message (the same the student sees when running the cell);
* only the hidden tests failed (the test raised ``HiddenTestFailure``): a sentence saying so;
* the grader skipped the cell (it stopped or hung the kernel), it timed out, or ran out of
  memory: that reason.

Written answers show their points, or that they await grading by hand.  Never shown: the
code of any test cell, tracebacks, printed output, and any message that quotes a line of
the hidden tests.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path

import nbformat

from autograder import gradebook, results
from autograder.release import HIDDEN_BEGIN, HIDDEN_END, source_path
from autograder.settings import COURSE_ROOT

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
    if ename == "CellTimeoutError":
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


def test_rows(autograded: Path, source: Path, grades: dict[str, tuple[float | None, float]],
              pending: set[str] = frozenset()) -> list[dict]:
    """One row per graded cell; ``pending``: written answers not graded by hand yet."""
    notebook = nbformat.read(autograded, as_version=4)
    sources = {}
    if source.exists():
        sources = {c.grade_id: c.source for c in results.graded_cells(nbformat.read(source, as_version=4))}
    rows = []
    for cell in results.graded_cells(notebook, autograded.stem):
        test_source = sources.get(cell.grade_id, cell.source)
        score, max_score = grades.get(cell.grade_id, (0.0, cell.points))
        if cell.manual:
            waiting = cell.grade_id in pending
            rows.append({"grade_id": cell.grade_id, "checks": "written answer, graded by hand",
                         "score": None if waiting else score, "max_score": max_score, "passed": not waiting,
                         "message": "" if not waiting else "awaiting grading by hand"})
            continue
        first_line = test_source.strip().splitlines()[0] if test_source.strip() else cell.grade_id
        rows.append({"grade_id": cell.grade_id, "checks": first_line.strip().strip('"').strip("'"),
                     "score": score, "max_score": max_score, "passed": cell.passed,
                     "message": explain(cell, test_source) if cell.error else ""})
    return rows


def render(student: str, assignment: str, notebook: str, rows: list[dict], notes: list[str]) -> str:
    total = sum(r["score"] or 0 for r in rows)
    possible = sum(r["max_score"] or 0 for r in rows)
    esc = html.escape
    title = assignment if notebook == assignment else f"{assignment}: {notebook}"
    body = [f"<h1>{esc(title)}</h1>",
            f"<p>Student: <b>{esc(student)}</b>. Score: <b>{total:g} / {possible:g}</b></p>"]
    if notes:
        body.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    body.append("<table><tr><th>test</th><th>what it checks</th><th>points</th><th>result</th></tr>")
    for r in rows:
        result = "passed" if r["passed"] else esc(r["message"])
        points = "-" if r["score"] is None else f"{r['score']:g}"
        body.append(f"<tr class='{'ok' if r['passed'] else 'fail'}'><td><code>{esc(r['grade_id'])}</code></td>"
                    f"<td>{esc(r['checks'])}</td><td>{points} / {(r['max_score'] or 0):g}</td>"
                    f"<td class='result'>{result}</td></tr>")
    body.append("</table>")
    # pre-wrap: a check's message is laid out in lines (expected / got / likely mistake)
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.4em;vertical-align:top;text-align:left}"
             "td.result{white-space:pre-wrap}"
             "tr.ok td:last-child{color:#070}tr.fail td:last-child{color:#a00}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)} feedback</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def _notes(graded_dir: Path) -> list[str]:
    """What the grader did to this submission, told to the student."""
    try:
        record = json.loads((graded_dir / ".grading.json").read_text())
    except (OSError, ValueError):
        return []
    notes = [results.describe(incident, for_student=True) for incident in record.get("incidents", [])]
    return list(dict.fromkeys(note for note in notes if note))


def write_feedback(root: Path = COURSE_ROOT) -> list[Path]:
    written = []
    if not (root / "gradebook.db").exists():
        return written
    with gradebook.open_gradebook(root) as gb:
        for assignment in gb.assignments:
            for submission in assignment.submissions:
                student = submission.student.id
                graded_dir = root / "autograded" / student / assignment.name
                for notebook in submission.notebooks:
                    autograded = graded_dir / f"{notebook.name}.ipynb"
                    if not autograded.exists():
                        continue
                    grades = {g.name: (g.score, g.max_score) for g in notebook.grades}
                    pending = {g.name for g in notebook.grades if g.needs_manual_grade}
                    rows = test_rows(autograded, source_path(root, assignment.name), grades, pending)
                    target = root / "feedback" / student / assignment.name / f"{notebook.name}.html"
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(render(student, assignment.name, notebook.name, rows, _notes(graded_dir)),
                                      encoding="utf-8")
                    written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=COURSE_ROOT)
    options = parser.parse_args(argv)
    written = write_feedback(options.root)
    print(f"wrote {len(written)} feedback files under {options.root / 'feedback'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
