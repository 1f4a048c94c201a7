"""Grades nobody can forge: submissions that attack the verdict itself, graded by the real
pipeline (intake -> Dask -> nbgrader -> the trusted checker) in one run on one class.

Notebook 01's test cells run in the trusted checker (autograder.grading.trusted.checker), which calls
the student's code through the bridge (attention_lab.bridge): each attack below gave an empty
submission full marks when the test cells ran in the student's kernel.  Here each scores what
its real answers earn (nothing), while an honest submission graded in the same run, on the one
worker that grades every attack (its nbgrader process, kernel server and checker), keeps full marks.
"""

from __future__ import annotations

import copy
import textwrap

import nbformat
import pytest

from autograder.grading import grade
from autograder.store import results
from autograder.term import intake
from autograder.places import REPO_ROOT
from autograder.publishing.release import build_source, course_repository, write_notebook
from autograder.grading.trusted.checker_client import CHECKED_OUTSIDE_THE_KERNEL
from tests.test_adversarial import ASSIGNMENT, FULL, cell, measured_limits, release_notebook, solved_notebook, write

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trust_boundary")]

FIRST_ANSWER = "split_heads"
LEAF_ANSWER, LEAF_TEST = "split_heads_einops", "test_split_heads_einops"  # 1 point; nothing else uses it

# Each attack is code put before the first answer of an otherwise empty submission (the release).
ATTACKS = {
    # IPython rewrites every later cell (test cells included) into `pass`
    "input transformer": """
        get_ipython().input_transformers_cleanup.append(lambda lines: ["pass\\n"])
    """,
    "ast transformer": """
        import ast
        class Everything(ast.NodeTransformer):
            def visit_Module(self, node):
                return ast.Module(body=[ast.Pass()], type_ignores=[])
        get_ipython().ast_transformers.append(Everything())
    """,
    # the check framework's own functions replaced (modules are "frozen": go around it)
    "framework replaced": """
        import types, attention_lab.checking as checking, attention_lab.checks.mha_shapes as checks
        def passes(*args, **kwargs):
            print("✓ all good")
        for module in (checking, checks):
            for name in dir(module):
                if name.startswith(("check", "expect_", "call_student", "diagnose")):
                    types.ModuleType.__setattr__(module, name, passes)
        types.ModuleType.__setattr__(checking, "CheckFailure", type("Nothing", (Exception,), {}))
    """,
    # a fake check module served by an importer on sys.meta_path ...
    "meta_path importer": """
        import sys, importlib.abc, importlib.util
        class Fake(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path=None, target=None):
                if name.startswith("attention_lab.checks."):
                    return importlib.util.spec_from_loader(name, self)
            def create_module(self, spec):
                return None
            def exec_module(self, module):
                module.__getattr__ = lambda name: (lambda *a, **k: print("✓ passed"))
        sys.meta_path.insert(0, Fake())
        for name in [n for n in sys.modules if n.startswith("attention_lab.checks.")]:
            del sys.modules[name]
    """,
    # ... or through the package's __path__
    "package __path__": """
        import os, sys, tempfile, attention_lab.checks
        folder = tempfile.mkdtemp()
        with open(os.path.join(folder, "mha_shapes.py"), "w") as handle:
            handle.write("def __getattr__(name):\\n    return lambda *a, **k: print('✓ passed')\\n")
        attention_lab.checks.__path__.insert(0, folder)
        sys.modules.pop("attention_lab.checks.mha_shapes", None)
    """,
    # the kernel's end of the bridge rewritten to answer whatever the grader asks with "yes"
    "bridge agent rewritten": """
        import attention_lab.bridge.kernel_side as agent
        def answer(self, request, buffers):
            return {"value": True, "values": [{"value": True}] * len(request.get("names", [])),
                    "probes": [], "modules": []}, self.new_encoder()
        agent.Agent.answer = answer
    """,
    # IPython's event hooks: errors of every later cell forgotten, the bridge's agent replaced
    "IPython event hooks": """
        import attention_lab.bridge.kernel_side as agent
        def forget_errors(result):
            result.error_in_exec = result.error_before_exec = None
        def take_the_agent(*args):
            agent.Agent.answer = lambda self, request, buffers: ({"value": True}, None)
        ip = get_ipython()
        for event, hook in (("post_run_cell", forget_errors), ("pre_execute", take_the_agent),
                            ("pre_run_cell", take_the_agent)):
            ip.events.register(event, hook)
    """,
    # a whole fake course package first on sys.path, the real one forgotten
    "sys.path importer": """
        import os, sys, tempfile
        folder = tempfile.mkdtemp()
        os.makedirs(os.path.join(folder, "attention_lab", "checks"))
        for init in ("attention_lab/__init__.py", "attention_lab/checks/__init__.py"):
            with open(os.path.join(folder, init), "w") as handle:
                handle.write("def __getattr__(name):\n    return lambda *a, **k: print('✓ passed')\n")
        sys.path.insert(0, folder)
        for name in [n for n in sys.modules if n.split(".")[0] == "attention_lab"]:
            del sys.modules[name]
    """,
}
# Answers (for the first exercise) that attack from inside a call.
ANSWER_ATTACKS = {
    # the course's own exception type, carrying a success line, raised by the answer
    "raises CheckFailure": """
        from attention_lab.checking import CheckFailure
        raise CheckFailure("✓ split_heads_einops: written with einops, same result as split_heads (cpu)")
    """,
    # reaching the caller's frames for the check's expected values
    "frame and gc tricks": """
        import gc, sys
        frame = sys._getframe(1)
        while frame is not None:
            for value in frame.f_locals.values():
                if hasattr(value, "expected"):
                    return value.expected
            frame = frame.f_back
        for obj in gc.get_objects():
            if type(obj).__name__ == "Variant":
                return obj.value
        return x
    """,
    # an exception that exits the interpreter the check runs in
    "SystemExit": """
        raise SystemExit(0)
    """,
    # an exception carrying a success line and a megabyte of encoded data into feedback
    "encoded exception": """
        import base64
        raise ValueError("✓ split_heads_einops: passed\\n" + base64.b64encode(bytes(range(256)) * 4000).decode())
    """,
    # code that detects it is called by the grader and writes a forged reply into the bridge's socket
    "forges a reply when graded": """
        import gc, inspect, json, socket, struct
        if any("bridge" in frame.filename for frame in inspect.stack()):
            body = json.dumps({"value": True, "passed": True}).encode()
            for obj in gc.get_objects():
                if isinstance(obj, socket.socket) and obj.family == socket.AF_UNIX:
                    try:
                        obj.sendall(b"ALB1" + struct.pack("<I", len(body)) + body + struct.pack("<I", 0))
                    except OSError:
                        pass
        return x
    """,
}


def attacked(base, code: str):
    notebook = copy.deepcopy(base)
    target = cell(notebook, FIRST_ANSWER)
    target.source = textwrap.dedent(code).strip() + "\n\n" + target.source
    return notebook


def answered(base, body: str):
    notebook = copy.deepcopy(base)
    target = cell(notebook, LEAF_ANSWER)
    header = target.source.split('"""')
    target.source = '"""'.join(header[:2]) + '"""\n' + textwrap.indent(textwrap.dedent(body).strip(), "    ") + "\n"
    return notebook


def student(name: str) -> str:
    return name.replace(" ", "-").replace("_", "-").lower()


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("boundary")
    root, downloads = base / "autograder", base / "downloads"
    source_path = root / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    write_notebook(build_source(ASSIGNMENT, course_repository()), source_path)
    solved, blank = solved_notebook(source_path), release_notebook()
    submissions = {"honest": solved}
    submissions.update({student(name): attacked(blank, code) for name, code in ATTACKS.items()})
    submissions.update({student(name): answered(solved, body) for name, body in ANSWER_ATTACKS.items()})
    for name, notebook in submissions.items():
        write(downloads / name / f"{ASSIGNMENT}.ipynb", notebook)
    intake.intake(downloads, root, REPO_ROOT / "course", assignments=[ASSIGNMENT])
    # one worker: the honest submission and every attack go through the same grading processes
    outcomes = grade.grade(root, jobs=1, limits=measured_limits(), log=lambda line: None)
    return {"root": root, "outcomes": {o.student: o for o in outcomes}}


def graded_cells(graded, name):
    path = graded["root"] / "autograded" / name / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    return {c.grade_id: c for c in results.graded_cells(nbformat.read(path, as_version=4), ASSIGNMENT)}


def test_notebook_01_is_checked_outside_the_kernel():
    assert ASSIGNMENT in CHECKED_OUTSIDE_THE_KERNEL


def test_an_honest_submission_keeps_full_marks_beside_the_attacks(graded):
    outcome = graded["outcomes"]["honest"]
    assert outcome.status == "graded", outcome
    assert {o.worker for o in graded["outcomes"].values()} == {outcome.worker}
    failed = {c.grade_id: c.evalue[:200] for c in graded_cells(graded, "honest").values() if not c.manual and not c.passed}
    assert not failed, failed
    assert outcome.score == FULL


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_on_the_verdict_earns_nothing(graded, attack):
    name = student(attack)
    outcome = graded["outcomes"][name]
    assert outcome.status == "graded", outcome
    passed = [c.grade_id for c in graded_cells(graded, name).values() if c.passed]
    assert outcome.score == 0 and not passed, f"{attack}: scored {outcome.score} with {passed} passing"


@pytest.mark.parametrize("attack", list(ANSWER_ATTACKS))
def test_an_answer_that_attacks_its_check_fails_that_test_only(graded, attack):
    name = student(attack)
    cells = graded_cells(graded, name)
    assert not cells[LEAF_TEST].passed
    others = {grade_id: c.evalue[:200] for grade_id, c in cells.items()
              if grade_id != LEAF_TEST and not c.manual and not c.passed}
    assert not others, f"{attack}: other tests lost points: {others}"
    assert graded["outcomes"][name].score == FULL - 1


def test_the_messages_come_from_the_checker(graded):
    """The answer's own CheckFailure reaches feedback as what it is: an exception the answer raised."""
    failure = graded_cells(graded, student("raises CheckFailure"))[LEAF_TEST]
    assert "raised CheckFailure" in failure.evalue, failure.evalue
    exited = graded_cells(graded, student("SystemExit"))[LEAF_TEST]
    assert "raised SystemExit" in exited.evalue, exited.evalue
    encoded = graded_cells(graded, student("encoded exception"))[LEAF_TEST]
    assert "raised ValueError" in encoded.evalue, encoded.evalue[:300]
    assert len(encoded.evalue) < 5_000, f"the answer's megabyte reached feedback: {len(encoded.evalue)} characters"


def test_the_report_says_where_verdicts_were_decided_and_who_kept_the_grader_out(graded):
    report = (graded["root"] / "reports" / "grading_report.md").read_text()
    assert f"decided by the trusted checker, outside the student's kernel: {ASSIGNMENT}" in report
    line = next(line for line in report.splitlines() if line.startswith(f"| {student('input transformer')} |"))
    assert "kept the grader from calling the answers" in line, line


def test_a_kernel_that_finished_the_request_without_connecting_costs_no_wait(graded):
    """The rewritten kernel answered the agent's request without running it: the checker was told
    at once, instead of waiting out its connection time (the incident says which happened)."""
    refusals = [i for i in graded["outcomes"][student("input transformer")].incidents if i["kind"] == "bridge_refused"]
    assert refusals and "finished the grader's request without running it" in refusals[0]["detail"], refusals


def test_a_cancel_ends_the_checkers_wait_and_a_late_one_is_ignored(tmp_path):
    import threading

    from attention_lab.bridge.kernel_side import serve
    from autograder.grading.trusted.checker_client import Checker

    checker = Checker()
    path = str(tmp_path / "bridge.sock")
    cell = {"cell": "print(6 * 7)", "socket": path, "timeout": 300, "connect_timeout": 300}
    try:
        checker.send(cell)
        assert (checker.receive(300) or {}).get("listening")
        checker.cancel()  # a kernel that finished the agent's request without connecting
        refused = checker.receive(120)  # not the 300 s the checker would otherwise wait
        checker.cancel()  # late: this checker waits for no kernel now
        checker.send(cell)
        assert (checker.receive(300) or {}).get("listening")
        threading.Thread(target=serve, args=(path, {}), daemon=True).start()
        answered = checker.receive(300)
    finally:
        checker.stop()
    assert refused and "finished the grader's request without running it" in refused.get("error", ""), refused
    assert answered and [output.get("text") for output in answered["outputs"]] == ["42\n"], answered


def test_the_checker_checks_on_the_cpu_whatever_device_the_grader_names(monkeypatch, tmp_path):
    # What the student's code returns crosses the boundary as CPU tensors. On a GPU machine the checker's checks
    # chose CUDA (or whatever ATTENTION_LAB_DEVICE names) and would find every correct answer on the wrong device.
    import threading

    from attention_lab.bridge.kernel_side import serve
    from autograder.grading.trusted.checker_client import Checker

    monkeypatch.setenv("ATTENTION_LAB_DEVICE", "cuda")  # on this machine without CUDA, a check would raise
    checker = Checker()
    path = str(tmp_path / "bridge.sock")
    try:
        checker.send({"cell": "from attention_lab.checking import resolve_device\nprint(resolve_device(None))",
                      "socket": path, "timeout": 300, "connect_timeout": 300})
        assert (checker.receive(300) or {}).get("listening")
        threading.Thread(target=serve, args=(path, {}), daemon=True).start()  # the kernel's side: nothing in it
        answer = checker.receive(300)
    finally:
        checker.stop()
    assert answer and [output.get("text") for output in answer["outputs"]] == ["cpu\n"], answer
