"""A submission's score as every reader shows it: the gradebook's points less the late penalty
that the course's rules give it *now*.

The late penalty is a rule of the course -- the penalty method and grace period (course
settings), the assignment's due date (gradebook), the student's extension (course settings)
and the submission's time (gradebook) -- not a number stored when the submission was graded.
A hand grade typed in Formgrader after grading, a due date moved with ``make deadlines``, an
extension given with ``make extension``: each changes what the rule gives, and every reader
(``grades.csv``, ``grades_by_question.csv``, the LMS export, the feedback pages, the class
report, Formgrader's late notes) computes it here when it reads, so no order of commands can
skip it.  ``make grade`` still writes nbgrader's own ``late_submission_penalty`` fields (for
nbgrader's tools), with the same function; nothing of this course reads them back.

    score = submission_score(submission, CourseSettings.load(root))
    score.raw, score.penalty, score.final, score.seconds_late
"""

from __future__ import annotations

from dataclasses import dataclass

from autograder.term.course_settings import CourseSettings


@dataclass(frozen=True)
class Score:
    raw: float            # the gradebook's points: autograded, graded by hand, extra credit
    max_score: float
    penalty: float        # what the late penalty takes, under the course's rules now
    seconds_late: float   # past the student's due date (an extension, if later) and the grace period
    pending: bool         # a written answer still waits for a hand grade

    @property
    def final(self) -> float:
        return max(0.0, self.raw - self.penalty)

    @property
    def late(self) -> bool:
        return self.seconds_late > 0


def late_penalty(method: str, student: str, score: float, seconds_late: float) -> float:
    """nbgrader's own rule (``LateSubmissionPlugin``, as ``AssignLatePenalties`` applies it):
    the points a notebook scoring ``score`` loses, within [0, score]."""
    from nbgrader.plugins import LateSubmissionPlugin

    if seconds_late <= 0:
        return 0.0
    penalty = LateSubmissionPlugin(penalty_method=method).late_submission_penalty(student, score, seconds_late)
    return 0.0 if penalty is None else min(max(float(penalty), 0.0), score)


def seconds_late(submission, settings: CourseSettings) -> float:
    """How late an nbgrader ``SubmittedAssignment`` is under the course settings."""
    return settings.seconds_late(submission.student.id, submission.assignment.name, submission.timestamp,
                                 submission.assignment.duedate)


def notebook_penalty(notebook, student: str, settings: CourseSettings, late: float) -> float:
    """The late penalty of one ``SubmittedNotebook`` that is ``late`` seconds late."""
    return late_penalty(settings.late_penalty, student, float(notebook.score), late)


def submission_score(submission, settings: CourseSettings) -> Score:
    """The score of an nbgrader ``SubmittedAssignment`` under the course settings (one notebook's
    penalty each, as nbgrader sums them)."""
    late = seconds_late(submission, settings)
    student = submission.student.id
    penalty = sum(notebook_penalty(notebook, student, settings, late) for notebook in submission.notebooks)
    return Score(raw=float(submission.score), max_score=float(submission.max_score), penalty=penalty,
                 seconds_late=late, pending=bool(submission.needs_manual_grade))


def question_scores(notebook, student: str, settings: CourseSettings, late: float) -> dict[str, tuple[float, float]]:
    """``{grade cell: (raw score, score after the late penalty)}`` of one ``SubmittedNotebook``:
    the notebook's penalty shared out in proportion to each question's points (the whole
    score under ``zero``, nothing under ``none``), so the questions add up to the notebook."""
    raw_total = float(notebook.score)
    kept = 1.0 - notebook_penalty(notebook, student, settings, late) / raw_total if raw_total > 0 else 1.0
    return {grade.name: (float(grade.score), float(grade.score) * kept) for grade in notebook.grades}


def lateness(seconds: float) -> str:
    """``2.0 hours`` / ``10 minutes`` / ``under a minute``: how late, in words (Canvas's late mark,
    without a time, is filed as 1 s late: autograder.term.intake_checks)."""
    hours = seconds / 3600
    if hours >= 1:
        return f"{hours:.1f} hours"
    return f"{seconds / 60:.0f} minutes" if seconds >= 60 else "under a minute"
