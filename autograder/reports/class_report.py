"""The class report: what a class did on each assignment, from the gradebook and the autograded notebooks.

    python -m autograder.reports.class_report                  # make report
    python -m autograder.reports.class_report --assignment 01_mha_shapes

Writes ``reports/class/<assignment>/index.html`` (with ``figures/*.png`` and the same numbers
in ``report.json``) in the course root, per assignment that has submissions, and
``reports/class/index.html`` linking them:

* the score distribution, overall and per question; mean, median and a **discrimination
  index** per question (the mean score, as a fraction of the question's points, of the top
  27 % of the class by total minus that of the bottom 27 %: near 0 the question does not
  separate strong from weak submissions, negative it favours the weak);
* the tests that fail most;
* **the most frequent mistakes by name**: the checks' hints found in the failure messages,
  counted per student through their stable identifiers (``attention_lab.hint_catalog``);
* **similar submissions**: pairs whose own answer code (the answer cells less what the
  release and the model solution already hold; comments and blank lines dropped: Python
  tokens) is near-identical
  (``difflib`` on the token sequences, pairs pre-selected by shared 5-token shingles);
* submissions not graded and why (the grading report's failures: time limit, crash), those
  waiting for ``make grade``, and incidents of graded ones (time limit, crash, tampering);
* totals still waiting for grading by hand are counted and marked incomplete;
* scores are **raw** -- the points the work earned, before the late penalty -- and say so: the
  figures measure the questions, not the deadline.  The late submissions are listed with both,
  the raw score and the score after the course's late penalty (:mod:`autograder.term.scores`, the
  score ``grades.csv`` and the LMS export give).

The report depends only on the course root's contents: run twice on the same gradebook, it
writes the same bytes.
"""

from __future__ import annotations

import difflib
import html
import io
import itertools
import json
import statistics
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from autograder.command_line import command_line
from autograder.places import COURSE_ROOT
from autograder.publishing.release import released_notebook
from autograder.store import gradebook, results
from autograder.term import scores
from autograder.term.course_settings import CourseSettings

SIMILARITY_THRESHOLD = 0.9     # difflib ratio of the answer tokens from which a pair is flagged
MIN_ANSWER_TOKENS = 30         # answers shorter than this (beyond the release's stubs) are not compared
SHINGLE = 5
GROUP_FRACTION = 0.27          # upper and lower groups of the discrimination index


@dataclass
class Student:
    id: str
    total: float                 # raw: before the late penalty
    max_score: float
    pending: bool
    late: scores.Score | None = None   # the score under the course's late penalty, when late
    scores: dict[str, float | None] = field(default_factory=dict)   # grade_id -> score (None: pending)
    failed_tests: list[str] = field(default_factory=list)
    hints: dict[str, list[str]] = field(default_factory=dict)       # hint id -> tests where it appeared
    incidents: list[str] = field(default_factory=list)
    answer_tokens: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------

def code_tokens(source: str) -> list[str]:
    """Python tokens of a cell, without comments, blank lines or indentation tokens."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    try:
        return [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in skip]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source.split()


def own_tokens(mine: list[str], given: list[list[str]]) -> list[str]:
    """The tokens of an answer that none of the ``given`` code has (the release's stub, the
    model solution): what the student wrote themselves, in order.  Correct answers converge on
    the model solution; comparing them whole flags every pair of correct submissions."""
    for known in given:
        if not mine or not known:
            continue
        matcher = difflib.SequenceMatcher(None, known, mine, autojunk=False)
        mine = [t for tag, _, _, j1, j2 in matcher.get_opcodes() if tag in ("replace", "insert") for t in mine[j1:j2]]
    return mine


def answer_tokens(notebook, given: dict[str, list[list[str]]]) -> list[str]:
    """The tokens of a notebook's code answer cells that the student wrote themselves (see
    :func:`own_tokens`; ``given``: per answer cell, the release's and the model's tokens)."""
    tokens = []
    for cell in notebook.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("solution"):
            continue
        tokens += own_tokens(code_tokens(cell.source), given.get(meta.get("grade_id"), []))
    return tokens


def given_code(root: Path, assignment: str) -> dict[str, list[list[str]]]:
    """Per answer cell, the tokens every student was given or could converge on: the release's
    stub (course/) and the model solution (the course root's source/)."""
    given: dict[str, list[list[str]]] = {}
    for path in (released_notebook(assignment), root / "source" / assignment / f"{assignment}.ipynb"):
        if path.exists():
            for cell in nbformat.read(path, as_version=4).cells:
                meta = cell.metadata.get("nbgrader", {})
                if cell.cell_type == "code" and meta.get("solution"):
                    given.setdefault(meta["grade_id"], []).append(code_tokens(cell.source))
    return given


def question_order(root: Path, assignment: str, notebooks) -> list[tuple[str, float, bool]]:
    """(grade_id, points, written answer?) in the order of the source notebook."""
    order = []
    for notebook in sorted(notebooks, key=lambda n: n.name):
        source = root / "source" / assignment / f"{notebook.name}.ipynb"
        if source.exists():
            order += [(c.grade_id, c.points, c.manual) for c in results.graded_cells(nbformat.read(source, as_version=4))]
        else:
            order += [(g.name, g.max_score, g.cell_type == "markdown") for g in sorted(notebook.grade_cells,
                                                                                       key=lambda g: g.name)]
    return order


def read_class(root: Path, assignment_name: str, gb) -> tuple[list[tuple[str, float, bool]], list[Student]]:
    from attention_lab.hint_catalog import identify

    settings = CourseSettings.load(root)
    assignment = gb.find_assignment(assignment_name)
    questions = question_order(root, assignment_name, assignment.notebooks)
    given = given_code(root, assignment_name)
    students = []
    for submission in sorted(assignment.submissions, key=lambda s: s.student.id):
        score = scores.submission_score(submission, settings)
        student = Student(submission.student.id, score.raw, score.max_score, score.pending,
                          score if score.late else None)
        graded_dir = root / "autograded" / student.id / assignment_name
        for notebook in submission.notebooks:
            for grade in notebook.grades:
                student.scores[grade.name] = None if grade.needs_manual_grade else float(grade.score)
            path = graded_dir / f"{notebook.name}.ipynb"
            if not path.exists():
                continue
            executed = nbformat.read(path, as_version=4)
            for cell in results.graded_cells(executed, notebook.name):
                if cell.manual or cell.passed:
                    continue
                student.failed_tests.append(cell.grade_id)
                for hint in identify(cell.evalue):
                    student.hints.setdefault(hint, []).append(cell.grade_id)
            student.answer_tokens += answer_tokens(executed, given)
        try:
            record = json.loads((graded_dir / ".grading.json").read_text())
        except (OSError, ValueError):
            record = {}
        student.incidents = list(dict.fromkeys(
            results.describe(i) for i in record.get("incidents", []) if results.describe(i)))
        students.append(student)
    return questions, students


def not_graded(root: Path, assignment: str, graded: set[str]) -> list[dict]:
    """Submissions of ``assignment`` without a grade, and why."""
    rows = {}
    try:
        report = json.loads((root / "reports" / "grading_report.json").read_text())
    except (OSError, ValueError):
        report = {}
    for outcome in report.get("submissions", []):
        if outcome.get("assignment") == assignment and outcome.get("status") == "failed":
            why = (outcome.get("error") or "failed").strip().splitlines()[0]
            incidents = "; ".join(filter(None, (results.describe(i) for i in outcome.get("incidents", []))))
            rows[outcome["student"]] = why + (f" ({incidents})" if incidents else "")
    submitted = root / "submitted"
    if submitted.is_dir():
        for folder in sorted(submitted.glob(f"*/{assignment}")):
            student = folder.parent.name
            if student not in graded and student not in rows and any(folder.glob("*.ipynb")):
                rows[student] = "not graded yet: run `make grade`"
    return [{"student": s, "why": rows[s]} for s in sorted(rows)]


# --------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------

def discrimination(students: list[Student], grade_id: str, points: float) -> float | None:
    """Upper-group minus lower-group mean fraction of ``grade_id`` (groups by total score)."""
    scored = [s for s in students if s.scores.get(grade_id) is not None]
    if len(scored) < 2 or not points:
        return None
    ranked = sorted(scored, key=lambda s: (-s.total, s.id))
    size = max(1, round(GROUP_FRACTION * len(ranked)))
    upper, lower = ranked[:size], ranked[-size:]

    def mean(group):
        return sum(s.scores[grade_id] for s in group) / (len(group) * points)

    return round(mean(upper) - mean(lower), 4)


def question_stats(questions, students: list[Student]) -> list[dict]:
    rows = []
    for grade_id, points, manual in questions:
        values = [s.scores[grade_id] for s in students if s.scores.get(grade_id) is not None]
        pending = sum(1 for s in students if grade_id in s.scores and s.scores[grade_id] is None)
        rows.append({
            "grade_id": grade_id, "points": points, "written": manual, "graded": len(values), "pending": pending,
            "mean": round(statistics.fmean(values), 4) if values else None,
            "median": statistics.median(values) if values else None,
            "full": sum(v >= points for v in values), "zero": sum(v <= 0 for v in values),
            "partial": sum(0 < v < points for v in values),
            "discrimination": discrimination(students, grade_id, points),
        })
    return rows


def similar_pairs(students: list[Student], threshold: float = SIMILARITY_THRESHOLD) -> list[dict]:
    """Pairs whose answer code is near-identical (ratio >= threshold), most similar first."""
    candidates = [s for s in students if len(s.answer_tokens) >= MIN_ANSWER_TOKENS]
    shingles = {s.id: {tuple(s.answer_tokens[i:i + SHINGLE]) for i in range(len(s.answer_tokens) - SHINGLE + 1)}
                for s in candidates}
    pairs = []
    for a, b in itertools.combinations(candidates, 2):
        union = shingles[a.id] | shingles[b.id]
        if not union or len(shingles[a.id] & shingles[b.id]) / len(union) < threshold / 2:
            continue
        ratio = difflib.SequenceMatcher(None, a.answer_tokens, b.answer_tokens, autojunk=False).ratio()
        if ratio >= threshold:
            pairs.append({"students": [a.id, b.id], "similarity": round(ratio, 4),
                          "identical": a.answer_tokens == b.answer_tokens})
    return sorted(pairs, key=lambda p: (-p["similarity"], p["students"]))


def build(root: Path, assignment: str, gb) -> dict:
    from attention_lab.hint_catalog import catalog

    questions, students = read_class(root, assignment, gb)
    totals = [s.total for s in students]
    max_score = max((s.max_score for s in students), default=0.0)
    failing: dict[str, int] = {}
    for student in students:
        for grade_id in set(student.failed_tests):
            failing[grade_id] = failing.get(grade_id, 0) + 1
    mistakes: dict[str, set[str]] = {}
    tests_of: dict[str, set[str]] = {}
    for student in students:
        for hint, tests in student.hints.items():
            mistakes.setdefault(hint, set()).add(student.id)
            tests_of.setdefault(hint, set()).update(tests)
    texts = {hint.id: hint.text for hint in catalog()}
    return {
        "assignment": assignment,
        "students": len(students),
        "max_score": max_score,
        "total": {"mean": round(statistics.fmean(totals), 4) if totals else None,
                  "median": statistics.median(totals) if totals else None,
                  "incomplete": sum(s.pending for s in students)},
        "scores": [{"student": s.id, "score": s.total, "incomplete": s.pending} for s in students],
        "late": [{"student": s.id, "late": scores.lateness(s.late.seconds_late), "raw_score": s.late.raw,
                  "late_penalty": s.late.penalty, "score": s.late.final} for s in students if s.late],
        "questions": question_stats(questions, students),
        "failing_tests": [{"grade_id": g, "students": n} for g, n in sorted(failing.items(), key=lambda i: (-i[1], i[0]))],
        "mistakes": [{"hint": h, "text": texts.get(h, ""), "students": len(who), "tests": sorted(tests_of[h])}
                     for h, who in sorted(mistakes.items(), key=lambda i: (-len(i[1]), i[0]))],
        "similar": similar_pairs(students),
        "not_graded": not_graded(root, assignment, {s.id for s in students}),
        "incidents": [{"student": s.id, "incident": text} for s in students for text in s.incidents],
    }


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------

def figures(data: dict, folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    figure, axis = plt.subplots(figsize=(7, 3.5))
    totals = [row["score"] for row in data["scores"]]
    top = data["max_score"] or 1
    axis.hist(totals, bins=min(20, max(5, int(top))), range=(0, top), color="#4a7ab5", edgecolor="white")
    axis.set(xlabel="raw total score (before late penalties)", ylabel="students",
             title=f"{data['assignment']}: raw total scores")
    axis.yaxis.get_major_locator().set_params(integer=True)
    figure.tight_layout()
    figure.savefig(folder / "scores.png", metadata={"Software": None})
    plt.close(figure)
    names.append("figures/scores.png")
    questions = data["questions"]
    if questions:
        figure, axis = plt.subplots(figsize=(7, 0.35 * len(questions) + 1.2))
        labels = [q["grade_id"] for q in questions][::-1]
        counts = {kind: [q[kind] for q in questions][::-1] for kind in ("full", "partial", "zero")}
        left = [0] * len(labels)
        for kind, colour in (("full", "#3a8a3a"), ("partial", "#d9a400"), ("zero", "#b03030")):
            axis.barh(labels, counts[kind], left=left, color=colour, label=kind)
            left = [a + b for a, b in zip(left, counts[kind])]
        axis.set(xlabel="students", title="per question: full / partial / zero marks")
        axis.legend(loc="lower right", fontsize="small")
        figure.tight_layout()
        figure.savefig(folder / "questions.png", metadata={"Software": None})
        plt.close(figure)
        names.append("figures/questions.png")
    return names


def _number(value) -> str:
    return "-" if value is None else f"{value:g}"


def render(data: dict, images: list[str]) -> str:
    esc = html.escape
    total = data["total"]
    out = [f"<h1>Class report: {esc(data['assignment'])}</h1>",
           f"<p>{data['students']} graded submissions; raw total out of {_number(data['max_score'])}: "
           f"mean {_number(total['mean'])}, median {_number(total['median'])}.</p>",
           f"<p class='raw' id='raw-scores'><b>Raw scores:</b> every score on this page is the points the work "
           f"earned, before the late penalty; {len(data['late'])} late submission{'s' if len(data['late']) != 1 else ''}"
           " (below) lose what the course settings take (grades.csv and the LMS export deduct it).</p>"]
    if total["incomplete"]:
        out.append(f"<p class='incomplete'><b>Incomplete:</b> {total['incomplete']} totals still wait for grading "
                   "by hand (Formgrader); they count those answers as 0.</p>")
    out += [f"<img src='{esc(i)}' alt='{esc(i)}'>" for i in images]
    if data["late"]:
        out.append("<h2>Late submissions</h2><table id='late'><tr><th>student</th><th>late by</th><th>raw score</th>"
                   "<th>late penalty</th><th>score</th></tr>")
        out += [f"<tr><td>{esc(r['student'])}</td><td>{esc(r['late'])}</td><td>{_number(r['raw_score'])}</td>"
                f"<td>{_number(r['late_penalty'])}</td><td>{_number(r['score'])}</td></tr>" for r in data["late"]]
        out.append("</table>")
    out.append("<h2>Questions</h2><table id='questions'><tr><th>question</th><th>points</th><th>mean</th>"
               "<th>median</th><th>discrimination</th><th>full</th><th>partial</th><th>zero</th><th>pending</th></tr>")
    for q in data["questions"]:
        out.append(f"<tr><td><code>{esc(q['grade_id'])}</code>{' (written)' if q['written'] else ''}</td>"
                   f"<td>{_number(q['points'])}</td><td>{_number(q['mean'])}</td><td>{_number(q['median'])}</td>"
                   f"<td>{_number(q['discrimination'])}</td><td>{q['full']}</td><td>{q['partial']}</td>"
                   f"<td>{q['zero']}</td><td>{q['pending']}</td></tr>")
    out.append("</table><h2>Tests that fail most</h2><table id='failing'><tr><th>test</th><th>students</th></tr>")
    out += [f"<tr><td><code>{esc(t['grade_id'])}</code></td><td>{t['students']}</td></tr>" for t in data["failing_tests"]]
    out.append("</table><h2>Most frequent mistakes</h2><table id='mistakes'><tr><th>mistake</th><th>hint</th>"
               "<th>in tests</th><th>students</th></tr>")
    out += [f"<tr><td><code>{esc(m['hint'])}</code></td><td>{esc(m['text'])}</td>"
            f"<td>{esc(', '.join(m['tests']))}</td><td>{m['students']}</td></tr>" for m in data["mistakes"]]
    out.append("</table><h2>Similar submissions</h2>")
    if data["similar"]:
        out.append("<table id='similar'><tr><th>students</th><th>answer code similarity</th></tr>")
        out += [f"<tr><td>{esc(' and '.join(p['students']))}</td><td>{p['similarity']:.0%}"
                f"{' (identical)' if p['identical'] else ''}</td></tr>" for p in data["similar"]]
        out.append("</table>")
    else:
        out.append("<p>No pair of submissions with near-identical answer code.</p>")
    out.append("<h2>Not graded</h2>")
    if data["not_graded"]:
        out.append("<table id='not-graded'><tr><th>student</th><th>why</th></tr>")
        out += [f"<tr><td>{esc(r['student'])}</td><td>{esc(r['why'])}</td></tr>" for r in data["not_graded"]]
        out.append("</table>")
    else:
        out.append("<p>Every submission was graded.</p>")
    if data["incidents"]:
        out.append("<h2>Incidents while grading</h2><table id='incidents'><tr><th>student</th><th>what happened</th></tr>")
        out += [f"<tr><td>{esc(r['student'])}</td><td>{esc(r['incident'])}</td></tr>" for r in data["incidents"]]
        out.append("</table>")
    style = ("body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:.3em .5em;text-align:left;vertical-align:top}"
             "img{max-width:100%;display:block;margin:1em 0}.incomplete{color:#a60}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Class report: {esc(data['assignment'])}</title>"
            f"<style>{style}</style></head><body>{''.join(out)}</body></html>\n")


def write_reports(root: Path = COURSE_ROOT, assignments: list[str] | None = None) -> list[Path]:
    root = Path(root)
    if not gradebook.exists(root):
        raise SystemExit(f"no gradebook in {root}: run `make intake` and `make grade` first")
    written = []
    with gradebook.exclusive(root) as gb:
        names = sorted(a.name for a in gb.assignments if a.submissions)
        for assignment in names:
            if assignments and assignment not in assignments:
                continue
            data = build(root, assignment, gb)
            folder = root / "reports" / "class" / assignment
            folder.mkdir(parents=True, exist_ok=True)
            images = figures(data, folder / "figures")
            (folder / "report.json").write_text(json.dumps(data, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
            (folder / "index.html").write_text(render(data, images), encoding="utf-8")
            written.append(folder / "index.html")
    if written:
        links = "".join(f"<li><a href='{html.escape(p.parent.name)}/index.html'>{html.escape(p.parent.name)}</a></li>"
                        for p in sorted((root / "reports" / "class").glob("*/index.html")))
        (root / "reports" / "class" / "index.html").write_text(
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Class reports</title></head><body>"
            f"<h1>Class reports</h1><ul>{links}</ul></body></html>\n", encoding="utf-8")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__, course_root=True)
    parser.add_argument("--assignment", action="append", help="only this assignment (repeatable)")
    options = parser.parse_args(argv)
    written = write_reports(options.root, options.assignment)
    for path in written:
        print(f"wrote {path}")
    if not written:
        print("no submissions in the gradebook yet: run `make intake SUBMISSIONS=<folder>` and `make grade` first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
