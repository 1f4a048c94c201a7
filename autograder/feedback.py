"""Feedback for each student that is honest and leaks nothing.

    python -m autograder.feedback            # make feedback (also: python -m autograder.grade --feedback)

For every graded submission, ``autograder/feedback/<student>/<assignment>/<notebook>.html``
(nbgrader's feedback folder, so ``nbgrader release_feedback`` still works) lists each test:
what it checks (the first line of the test cell), points earned / possible (from the
gradebook, so it agrees with grades.csv) and, when it failed:

* the visible check failed: its message (the same the student sees when running the cell);
* only the hidden tests failed: a sentence saying so, nothing more;
* the grader skipped the cell (it stopped or hung the kernel), it timed out, or ran out of
  memory: that reason.

Never shown: the code of any test cell, tracebacks, printed output, and any message that
quotes a line of the hidden tests.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
from pathlib import Path

import nbformat

from autograder.nbgrader_cli import AUTOGRADER_DIR

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
HIDDEN_BEGIN = "### BEGIN HIDDEN TESTS"
HIDDEN_END = "### END HIDDEN TESTS"
MAX_MESSAGE = 1500


def hidden_section(source: str) -> tuple[int | None, list[str]]:
    """(1-based line of BEGIN HIDDEN TESTS or None, distinctive lines of the hidden code)."""
    lines = source.splitlines()
    for number, line in enumerate(lines, start=1):
        if line.strip() == HIDDEN_BEGIN:
            hidden = []
            for other in lines[number:]:
                if other.strip() == HIDDEN_END:
                    break
                if len(other.strip()) >= 8:
                    hidden.append(other.strip())
            return number, hidden
    return None, []


def failing_line(error: dict) -> int | None:
    """Line of the test cell where the error was raised (from IPython's traceback)."""
    for entry in error.get("traceback", []):
        text = ANSI.sub("", entry)
        match = re.search(r"(?:Cell In\[\d+\]|<ipython-input-[^>]*>), line (\d+)", text)
        if match:
            return int(match.group(1))
        match = re.search(r"^-*>\s*(\d+)\s", text, re.MULTILINE)
        if match:
            return int(match.group(1))
    return None


def explain(error: dict, test_source: str, timeout_hint: str = "") -> str:
    """What a student may be told about a failed test cell."""
    ename = str(error.get("ename", "Error"))
    evalue = ANSI.sub("", str(error.get("evalue", ""))).strip()
    if ename == "GraderSkippedCell":
        return f"Not run: {evalue}."
    if ename == "CellTimeoutError":
        return f"Stopped: the test ran past the time limit{timeout_hint}. Look for an endless loop or very slow code."
    if ename == "MemoryError":
        return "Stopped: your code ran out of memory during this test."
    begin, hidden = hidden_section(test_source)
    line = failing_line(error)
    if begin is not None and (line is None or line > begin):
        return ("Your answer passed the visible check but failed the hidden tests (other random inputs, "
                "the CPU, edge cases). Test it on other shapes and values.")
    if any(h in evalue for h in hidden):
        return f"{ename} (message withheld: it quotes the grader's hidden tests)."
    message = f"{ename}: {evalue}" if evalue else ename
    return message[:MAX_MESSAGE] + ("…" if len(message) > MAX_MESSAGE else "")


def test_rows(autograded: Path, source: Path, grades: dict[str, tuple[float, float]]) -> list[dict]:
    notebook = nbformat.read(autograded, as_version=4)
    sources = {}
    if source.exists():
        for cell in nbformat.read(source, as_version=4).cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if grade_id:
                sources[grade_id] = cell.source
    rows = []
    for cell in notebook.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade"):
            continue
        grade_id = meta["grade_id"]
        test_source = sources.get(grade_id, cell.source)
        doc = test_source.strip().splitlines()[0].strip().strip('"').strip("'") if test_source.strip() else grade_id
        score, max_score = grades.get(grade_id, (0.0, float(meta.get("points", 0))))
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        rows.append({"grade_id": grade_id, "checks": doc, "score": score, "max_score": max_score,
                     "passed": not errors, "message": explain(errors[0], test_source) if errors else ""})
    return rows


def render(student: str, assignment: str, notebook: str, rows: list[dict], notes: list[str]) -> str:
    total = sum(r["score"] or 0 for r in rows)
    possible = sum(r["max_score"] or 0 for r in rows)
    esc = html.escape
    body = [f"<h1>{esc(assignment)} — {esc(notebook)}</h1>",
            f"<p>Student: <b>{esc(student)}</b>. Score: <b>{total:g} / {possible:g}</b></p>"]
    if notes:
        body.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    body.append("<table><tr><th>test</th><th>what it checks</th><th>points</th><th>result</th></tr>")
    for r in rows:
        result = "passed" if r["passed"] else esc(r["message"])
        body.append(f"<tr class='{'ok' if r['passed'] else 'fail'}'><td><code>{esc(r['grade_id'])}</code></td>"
                    f"<td>{esc(r['checks'])}</td><td>{(r['score'] or 0):g} / {(r['max_score'] or 0):g}</td>"
                    f"<td>{result}</td></tr>")
    body.append("</table>")
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.4em;vertical-align:top;text-align:left}"
             "tr.ok td:last-child{color:#070}tr.fail td:last-child{color:#a00}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(assignment)} feedback</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def _notes(graded_dir: Path) -> list[str]:
    try:
        record = json.loads((graded_dir / ".grading.json").read_text())
    except (OSError, ValueError):
        return []
    notes = []
    for incident in record.get("incidents", []):
        where = incident.get("grade_id") or f"cell {int(incident.get('cell_index', 0)) + 1}"
        kind = incident.get("kind")
        if kind in ("kernel_died", "kernel_unresponsive", "notebook_timeout"):
            notes.append(f"{where} stopped the Python kernel or hung it; the grader skipped that cell "
                         "and graded the rest.")
        elif kind == "output_truncated":
            notes.append(f"{where} printed too much output; it was cut.")
        elif kind == "tampering":
            notes.append(f"Before {where}, the grader undid a replacement of course modules by the notebook.")
    return notes


def write_feedback(root: Path = AUTOGRADER_DIR) -> list[Path]:
    from nbgrader.api import Gradebook

    from autograder.grade import COURSE_ID, db_url

    written = []
    if not (root / "gradebook.db").exists():
        return written
    with Gradebook(db_url(root), COURSE_ID) as gb:
        for assignment in gb.assignments:
            for submission in assignment.submissions:
                student = submission.student.id
                graded_dir = root / "autograded" / student / assignment.name
                for notebook in submission.notebooks:
                    autograded = graded_dir / f"{notebook.name}.ipynb"
                    if not autograded.exists():
                        continue
                    grades = {g.name: (g.score, g.max_score) for g in notebook.grades}
                    source = root / "source" / assignment.name / f"{notebook.name}.ipynb"
                    rows = test_rows(autograded, source, grades)
                    target = root / "feedback" / student / assignment.name / f"{notebook.name}.html"
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(render(student, assignment.name, notebook.name, rows, _notes(graded_dir)),
                                      encoding="utf-8")
                    written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=AUTOGRADER_DIR)
    options = parser.parse_args(argv)
    written = write_feedback(options.root)
    print(f"wrote {len(written)} feedback files under {options.root / 'feedback'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
