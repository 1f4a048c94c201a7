"""Grades nobody can forge: submissions that attack the verdict itself, graded by the real
pipeline (intake -> Dask -> nbgrader -> the trusted checker) in one run on one class.

Notebook 01's test cells run in the trusted checker (autograder.grading.trusted.checker), which calls
the student's code through the bridge (attention_lab.bridge): each attack below gave an empty
submission full marks when the test cells ran in the student's kernel.  Here each scores what
its real answers earn (nothing), while an honest submission graded in the same run, on the one
worker that grades every attack (its nbgrader process, kernel server and checker), keeps full marks.

The same run grades the second round's attacks: answers that change the check's own objects (notebook
01's load_torch_mha_weights writing into torch_mha, 04's conv_to_linear into the check's convolution,
05's LlamaAttention into its config, 03's CoordinateMLP into the encoder's buffer) and kernels whose
measurements lie (01's tripwire disabled, 02's reading of the code patched). Each such submission is
the release (or the solutions) with a few answers written; beside each attack, what its own answers
earn without the trick. The rules one by one are in tests/test_bridge_boundary.py.
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


# The second round (each a solved notebook, some answers rewritten): attention written with
# F.scaled_dot_product_attention under a tripwire the notebook disabled in its kernel (every from-scratch
# rule said "clean": 21/22 instead of 10/22 before the checker read the code itself), and a
# load_torch_mha_weights that copies the student's module into the check's torch_mha.
TRIPWIRE_OFF = """
import attention_lab.checking as checking
checking._TripwireMode.__torch_function__ = lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {}))
"""
BUILT_IN_ANSWERS = {
    "attention_weights": """
        def attention_weights(q, k, mask=None):
            keys = k.shape[-2]
            eye = torch.eye(keys, dtype=q.dtype, device=q.device).expand(*k.shape[:-2], keys, keys)
            return torch.nn.functional.scaled_dot_product_attention(q, k, eye, attn_mask=mask)
    """,
    "load_torch_mha_weights": """
        def load_torch_mha_weights(module, torch_mha):
            with torch.no_grad():  # the wrong direction: into the check's torch_mha
                torch_mha.in_proj_weight.copy_(torch.cat([module.q_linear.weight, module.k_linear.weight,
                                                          module.v_linear.weight]))
                torch_mha.out_proj.weight.copy_(module.out_linear.weight)
                if torch_mha.in_proj_bias is not None:
                    torch_mha.in_proj_bias.copy_(torch.cat([module.q_linear.bias, module.k_linear.bias,
                                                            module.v_linear.bias]))
                    torch_mha.out_proj.bias.copy_(module.out_linear.bias)
    """,
}
FROM_SCRATCH_TESTS = {"test_attention_weights", "test_scaled_dot_product_attention", "test_MultiHeadSelfAttention"}


def rewritten(base, answers: dict[str, str], prefix: str = ""):
    """Copy of ``base`` whose answer cells ``answers`` are rewritten, and ``prefix`` before the first answer."""
    notebook = attacked(base, prefix) if prefix else copy.deepcopy(base)
    for grade_id, source in answers.items():
        cell(notebook, grade_id).source = textwrap.dedent(source).strip() + "\n"
    return notebook


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


LLAMA_PARTS = ["causal_mask", "rope_frequencies", "apply_rope", "qk_norm", "repeat_kv", "KVCache", "LlamaAttention"]
LLAMA_TESTS = {"test_LlamaAttention", "test_LlamaAttention_kv_cache"}
NO_QK_NORM = ("if self.config.use_qk_norm:", "if False:  # no QK norm")
# Notebook 05: a model without QK norm turns it off in the config it is given, so that the check's
# reference, reading that config, drops QK norm too ...
TURNS_QK_NORM_OFF = ("self.config = config", "config.use_qk_norm = False\n        self.config = config")
# ... or puts a look-alike there: equal to anything, and false.
LOOKS_FALSE = ("self.config = config", "config.use_qk_norm = type('LooksFalse', (), {'__eq__': lambda s, o: True, "
               "'__bool__': lambda s: False, '__hash__': object.__hash__})()\n        self.config = config")
# Notebook 04: a random Linear, and its weights copied into the check's convolution (before the fix,
# the expected weights and outputs were read from that convolution after the call).
RANDOM_LINEAR_INTO_THE_CONV = '''
def conv_to_linear(patch_embedding):
    conv = patch_embedding.proj
    linear = nn.Linear(conv.weight[0].numel(), conv.weight.shape[0], bias=conv.bias is not None,
                       dtype=conv.weight.dtype, device=conv.weight.device)
    with torch.no_grad():
        conv.weight.copy_(linear.weight.reshape(conv.weight.shape))
        if conv.bias is not None:
            conv.bias.copy_(linear.bias)
    return linear
'''
# Notebook 03: a correct CoordinateMLP that scales every buffer of the encoder it is given, in place.
SCALES_THE_ENCODER = ("self.encoder = encoder", "self.encoder = encoder\n        if encoder is not None:\n"
                      "            for buffer in encoder.buffers():\n                buffer.mul_(2.0)")
# Notebook 02: the kernel's reading of an answer's code patched to find no shortcut and a loop, and a
# matrix product the array guard cannot see (a converted input).
PATCHED_CODE_READING = '''
import attention_lab.code_inspection as code_inspection
code_inspection.CodeFacts.measure = lambda self, answer: {"uses": [], "loops": True}

def row_times_matrix(x_row, W):
    return np.asarray(x_row) @ np.asarray(W)
'''


def submission(assignment: str, solved: list[str], replaced: dict[str, str] | None = None,
               edits: dict[str, tuple[tuple[str, str], ...]] | None = None) -> nbformat.NotebookNode:
    """The release of ``assignment`` with the answers ``solved`` written as the solutions write them,
    those of ``replaced`` written anew, and ``edits`` ({answer: ((text, replacement), ...)}) made to solutions."""
    source = build_source(assignment, course_repository())
    solutions = {c.metadata["nbgrader"]["grade_id"]: c.source for c in source.cells
                 if c.metadata.get("nbgrader", {}).get("solution")}
    notebook = nbformat.read(REPO_ROOT / "course" / f"{assignment}.ipynb", as_version=4)
    for answer in notebook.cells:
        grade_id = answer.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in (replaced or {}):
            answer.source = textwrap.dedent(replaced[grade_id]).strip() + "\n"
        elif grade_id in solved:
            answer.source = "\n".join(line for line in solutions[grade_id].splitlines()
                                      if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))
            for old, new in (edits or {}).get(grade_id, ()):
                assert old in answer.source, f"{grade_id}: no {old!r} to edit"
                answer.source = answer.source.replace(old, new, 1)
    return notebook


def llama(*edits: tuple[str, str]) -> nbformat.NotebookNode:
    """Notebook 05 with LlamaAttention and its parts written, LlamaAttention edited by ``edits``."""
    return submission("05_llama_attention", LLAMA_PARTS, edits={"LlamaAttention": edits})


OTHER_NOTEBOOKS = {  # student: (assignment, the submission)
    "llama-turns-qk-norm-off": ("05_llama_attention", lambda: llama(NO_QK_NORM, TURNS_QK_NORM_OFF)),
    "llama-looks-false": ("05_llama_attention", lambda: llama(NO_QK_NORM, LOOKS_FALSE)),
    "conv-into-the-check": ("04_vision_transformer", lambda: submission(
        "04_vision_transformer", [], replaced={"conv_to_linear": RANDOM_LINEAR_INTO_THE_CONV})),
    "mlp-scales-the-encoder": ("03_positions_and_blocks", lambda: submission(
        "03_positions_and_blocks", ["CoordinateMLP"], edits={"CoordinateMLP": (SCALES_THE_ENCODER,)})),
    "row-patched-code-reading": ("02_numpy_walkthrough", lambda: submission(
        "02_numpy_walkthrough", [], replaced={"row_times_matrix": PATCHED_CODE_READING})),
    "zz-honest-llama": ("05_llama_attention", lambda: llama()),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("boundary")
    root, downloads = base / "autograder", base / "downloads"
    assignments = sorted({ASSIGNMENT, *(assignment for assignment, _ in OTHER_NOTEBOOKS.values())})
    for assignment in assignments:
        write_notebook(build_source(assignment, course_repository()), root / "source" / assignment / f"{assignment}.ipynb")
    solved, blank = solved_notebook(root / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"), release_notebook()
    submissions = {"honest": solved}
    submissions.update({student(name): attacked(blank, code) for name, code in ATTACKS.items()})
    submissions.update({student(name): answered(solved, body) for name, body in ANSWER_ATTACKS.items()})
    submissions["built-ins-tripwire-off"] = rewritten(solved, BUILT_IN_ANSWERS, TRIPWIRE_OFF)
    submissions["built-ins"] = rewritten(solved, BUILT_IN_ANSWERS)  # what those answers earn
    for name, notebook in submissions.items():
        write(downloads / name / f"{ASSIGNMENT}.ipynb", notebook)
    for name, (assignment, build) in OTHER_NOTEBOOKS.items():
        write(downloads / name / f"{assignment}.ipynb", build())
    intake.intake(downloads, root, REPO_ROOT / "course", assignments=assignments)
    # one worker: the honest submissions and every attack go through the same grading processes
    outcomes = grade.grade(root, jobs=1, limits=measured_limits(), log=lambda line: None)
    return {"root": root, "outcomes": {o.student: o for o in outcomes}}


def graded_cells(graded, name, assignment=ASSIGNMENT):
    path = graded["root"] / "autograded" / name / assignment / f"{assignment}.ipynb"
    return {c.grade_id: c for c in results.graded_cells(nbformat.read(path, as_version=4), assignment)}


def passed(graded, name: str) -> set[str]:
    assignment = OTHER_NOTEBOOKS[name][0] if name in OTHER_NOTEBOOKS else ASSIGNMENT
    return {grade_id for grade_id, c in graded_cells(graded, name, assignment).items() if c.passed}


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


# --------------------------------------------------------------------------------------
# The second round: the check's own objects, and measurements that lie
# --------------------------------------------------------------------------------------

def test_a_disabled_tripwire_buys_no_from_scratch_test_and_is_reported(graded):
    """Notebook 01: attention written with F.scaled_dot_product_attention earns what it earns with the
    kernel's tripwire working (the checker reads the answers' code itself), and the report says that the
    kernel's "clean" contradicts the code; load_torch_mha_weights' write into torch_mha fails its test."""
    attack, real = graded["outcomes"]["built-ins-tripwire-off"], graded["outcomes"]["built-ins"]
    assert passed(graded, "built-ins-tripwire-off") == passed(graded, "built-ins")
    assert attack.score == real.score and not FROM_SCRATCH_TESTS & passed(graded, "built-ins-tripwire-off")
    contradicted = {i["grade_id"] for i in attack.incidents if i["kind"] == "measurement_contradicted"}
    assert FROM_SCRATCH_TESTS <= contradicted, attack.incidents
    assert not [i for i in real.incidents if i["kind"] == "measurement_contradicted"], real.incidents
    load = graded_cells(graded, "built-ins-tripwire-off")["test_load_torch_mha_weights"].evalue
    assert "changed the torch_mha it was given: its tensor `in_proj_weight` changed" in load, load


def test_an_honest_llama_graded_after_the_attacks_keeps_its_points(graded):
    outcomes = graded["outcomes"]
    assert {o.status for o in outcomes.values()} == {"graded"}, {s: o.error for s, o in outcomes.items()}
    assert len({o.worker for o in outcomes.values()}) == 1
    honest = passed(graded, "zz-honest-llama")
    assert LLAMA_TESTS <= honest and {"test_qk_norm", "test_KVCache", "test_apply_rope"} <= honest, honest
    # an honest kernel's measurements never contradict its code: nothing to report for either honest student
    assert outcomes["zz-honest-llama"].incidents == [] and outcomes["honest"].incidents == [], \
        (outcomes["zz-honest-llama"].incidents, outcomes["honest"].incidents)


@pytest.mark.parametrize("attack", ["llama-turns-qk-norm-off", "llama-looks-false"])
def test_a_llama_that_changes_its_config_earns_what_its_answers_earn(graded, attack):
    """Notebook 05: the constructor's change of the config fails the call that made it (the check keeps
    its own config, and gave a copy): a model without QK norm earns its other answers' points and none of
    LlamaAttention's (30/32 of a solved notebook before the fix, 23/32 without the trick)."""
    assert passed(graded, attack) == passed(graded, "zz-honest-llama") - LLAMA_TESTS
    failure = graded_cells(graded, attack, "05_llama_attention")["test_LlamaAttention"].evalue
    assert "your `LlamaAttention.__init__` changed the config it was given: `use_qk_norm` True →" in failure, failure


def test_a_conv_to_linear_that_writes_into_the_checks_conv_fails(graded):
    """Notebook 04: the random Linear copied into the check's convolution is judged against the
    convolution the check made, and the write itself is named."""
    failure = graded_cells(graded, "conv-into-the-check", "04_vision_transformer")["test_conv_to_linear"]
    assert not failure.passed
    assert "changed the patch_embedding it was given: its tensor `proj.weight` changed" in failure.evalue, failure.evalue


def test_a_module_buffer_changed_in_place_fails_its_test(graded):
    """Notebook 03: a CoordinateMLP that scales the buffers of the check's encoder (otherwise correct)."""
    failure = graded_cells(graded, "mlp-scales-the-encoder", "03_positions_and_blocks")["test_CoordinateMLP"]
    assert "changed the encoder it was given: its tensor `projection` changed" in failure.evalue, failure.evalue


def test_a_patched_code_reading_buys_nothing_and_is_reported(graded):
    """Notebook 02: the kernel's reading of the code says "a loop, no shortcut"; the checker reads the
    submitted cell itself, finds @, and the report says the two disagree."""
    failure = graded_cells(graded, "row-patched-code-reading", "02_numpy_walkthrough")["test_row_times_matrix"]
    assert "but it calls @ (in row_times_matrix" in failure.evalue, failure.evalue
    incidents = graded["outcomes"]["row-patched-code-reading"].incidents
    assert any(i["kind"] == "measurement_contradicted" and "the kernel read no @" in i["detail"]
               for i in incidents), incidents
    report = (graded["root"] / "reports" / "grading_report.md").read_text()
    line = next(line for line in report.splitlines() if line.startswith("| row-patched-code-reading |"))
    assert "test_row_times_matrix: TAMPERING? the kernel's measurement disagrees with the submitted code" in line, line
