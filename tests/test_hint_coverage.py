"""The hint-coverage gate: how hints are found, how failure messages are recorded, and when the
run is judged (tests/hint_coverage.py, the hooks in tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from attention_lab import checking
from attention_lab.checking import HINT_LOG_ENV_VAR, CheckFailure, expect_close
from attention_lab.hint_catalog import Hint, hints_in
from tests import hint_coverage, session_gates

FAKE_MODULE = {
    "SPLIT_HINTS": {"reshape_only": "you reshaped straight to [B, H, S, d_head]",
                    "scale": "divide by sqrt({d_head}), not by {d_head}",
                    ("tuple", "key"): {"inner": "a nested hint", "list": ["first of a list", "second of a list"]}},
    "HINTS": {"downcast": "kept float32"},
    "NOT_A_TABLE": {"x": "not a hint: the name does not end in _HINTS"},
    "SOME_HINTS": "a string, not a dict",
}


def test_hints_are_every_string_in_dicts_named_hints():
    hints = hints_in("fake", FAKE_MODULE)
    assert {(h.table, h.key, h.text) for h in hints} == {
        ("SPLIT_HINTS", "reshape_only", "you reshaped straight to [B, H, S, d_head]"),
        ("SPLIT_HINTS", "scale", "divide by sqrt({d_head}), not by {d_head}"),
        ("SPLIT_HINTS", "tuplexkey/inner", "a nested hint"),
        ("SPLIT_HINTS", "tuplexkey/list/0", "first of a list"),
        ("SPLIT_HINTS", "tuplexkey/list/1", "second of a list"),
        ("HINTS", "downcast", "kept float32"),
    }
    assert hints[0].where() == "fake.SPLIT_HINTS[reshape_only]"
    assert hints[0].id == "fake.split/reshape_only"


def test_a_hint_counts_as_triggered_only_when_a_message_contains_it():
    hints = hints_in("fake", FAKE_MODULE)
    messages = [
        "split_heads(x) does not match...\n  Likely mistake: you reshaped straight to\n[B, H, S,   d_head]",  # rewrapped
        "Likely mistake: divide by sqrt(16), not by 16",  # format fields filled in
        "a nested hint, and first of a list",
    ]
    missing = hint_coverage.untriggered(hints, messages)
    assert [h.text for h in missing] == ["second of a list", "kept float32"]
    assert hint_coverage.untriggered(hints, []) == hints
    # A hint is not "triggered" by a message that contains only part of it.
    assert hint_coverage.untriggered([Hint("m.t/k", "m", "T_HINTS", "k", "divide by sqrt({d}) first")],
                                     ["divide by sqrt(4)"]) != []
    # Braces that are not format fields are matched literally.
    assert hint_coverage.untriggered([Hint("m.t/k", "m", "T_HINTS", "k", "use {0, 1} masks}")], ["use {0, 1} masks}"]) == []
    # A format field matches text of one message, never the start of one and the end of the next.
    split = Hint("m.t/k", "m", "T_HINTS", "k", "divide by sqrt({d}) first")
    assert hint_coverage.untriggered([split], ["divide by sqrt(4", "16) first"]) == [split]
    assert hint_coverage.untriggered([split], ["x", "divide by sqrt(4) first"]) == []


def test_the_report_names_each_missing_hint_with_module_dict_and_key():
    missing = [Hint("fake.split/scale", "attention_lab.checks.fake", "SPLIT_HINTS", "scale", "divide by sqrt(d_head)")]
    lines = hint_coverage.report(missing, total=7, whole=True, enforced=True)
    assert lines[0].startswith("hint coverage FAILED: 1 of 7 hints never appeared")
    assert lines[1] == "  attention_lab.checks.fake.SPLIT_HINTS[scale]: divide by sqrt(d_head)"
    assert "not enforced yet" in hint_coverage.report(missing, 7, whole=True, enforced=False)[0]
    assert hint_coverage.report(missing, 7, whole=False, enforced=True) == [
        "hint coverage: not judged (only part of the suite ran); 6 of 7 hints appeared in a failure message in this run."]
    assert hint_coverage.report([], 7, whole=True, enforced=True) == ["hint coverage: all 7 hints appeared in a failure message."]
    # A subset run lists what it missed in the modules whose tests ran, and only those.
    other = Hint("other.hints/k", "attention_lab.checks.other", "HINTS", "k", "another hint")
    lines = hint_coverage.report([missing[0], other], 7, whole=False, enforced=True, modules={"attention_lab.checks.fake"})
    assert lines[1:] == ["  not triggered by this run, in the check modules whose tests ran (1):",
                         "  attention_lab.checks.fake.SPLIT_HINTS[scale]: divide by sqrt(d_head)"]


def test_a_check_test_file_names_its_check_module(tmp_path):
    for name in ("test_checks_mha_shapes.py", "test_checks_llama_attention.py", "test_other.py"):
        (tmp_path / name).write_text("")
    assert hint_coverage.modules_under_test([str(tmp_path / "test_checks_mha_shapes.py") + "::test_x"]) == \
        {"attention_lab.checks.mha_shapes"}
    assert hint_coverage.modules_under_test([str(tmp_path)]) == {"attention_lab.checks.mha_shapes",
                                                                "attention_lab.checks.llama_attention"}
    assert hint_coverage.modules_under_test([str(tmp_path / "test_other.py")]) == set()


def test_only_a_run_of_every_check_test_without_selection_is_judged(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in ("test_checks_a.py", "test_checks_b.py", "test_checking.py", "test_other.py"):
        (tests / name).write_text("")
    plain = SimpleNamespace(keyword="", markexpr="", deselect=None, lf=False, exitfirst=False)
    judged = lambda args, **changes: hint_coverage.whole_suite_ran(  # noqa: E731
        SimpleNamespace(**{**vars(plain), **changes}), [str(tmp_path / a) for a in args], tests)
    assert judged(["tests"]) and judged(["."])
    assert judged(["tests/test_checks_a.py", "tests/test_checks_b.py", "tests/test_checking.py"])
    assert not judged(["tests/test_checks_a.py", "tests/test_checks_b.py"])  # the framework's own hints
    assert not judged(["tests/test_checks_a.py"])
    assert not judged(["tests/test_other.py"])
    assert not judged(["tests/test_checks_a.py::test_x", "tests/test_checks_b.py"])
    assert not judged(["tests"], keyword="split_heads")
    assert not judged(["tests"], markexpr="not slow")
    assert not judged(["tests"], deselect=["tests/test_checks_a.py::test_x"])
    assert not judged(["tests"], lf=True)
    assert hint_coverage.covers_every_check_test(["tests"], tests_dir=tmp_path / "nothing-here") is False


def _judged(tmp_path, messages, args):
    return session_gates.judged_session(tmp_path, "hint coverage", "failures-1.jsonl", messages, args)


def test_the_gate_fails_a_whole_run_with_an_untriggered_hint_only_when_switched_on(tmp_path, monkeypatch):
    from tests import conftest

    everything = [hint.text for hint in hint_coverage.package_hints()]
    whole = [str(hint_coverage.TESTS_DIR)]
    for case, (enforced, messages, args, expected) in enumerate([
        (True, everything[1:], whole, pytest.ExitCode.TESTS_FAILED),  # one hint never triggered
        (True, everything, whole, pytest.ExitCode.OK),  # all triggered
        (True, [], [str(hint_coverage.TESTS_DIR / "test_checking.py")], pytest.ExitCode.OK),  # a subset: a note only
        (False, [], whole, pytest.ExitCode.OK),  # gate off: listed, not failed
    ]):
        monkeypatch.setattr(conftest, "HINT_COVERAGE_ENFORCED", enforced)
        status, report = _judged(tmp_path / str(case), messages, args)
        assert status == expected, (enforced, len(messages), args)
        if expected == pytest.ExitCode.TESTS_FAILED:
            assert report[0].startswith("hint coverage FAILED: 1 of") and everything[0][:60] in report[1]


def test_the_package_hint_tables_are_found():
    hints = hint_coverage.package_hints()
    where = {hint.where(): hint.text for hint in hints}
    assert where["attention_lab.checking.HINTS[downcast]"] == checking.HINTS["downcast"]
    from attention_lab.checks import mha_shapes

    assert where["attention_lab.checks.mha_shapes.SPLIT_HEADS_HINTS[reshape_only]"] == \
        mha_shapes.SPLIT_HEADS_HINTS["reshape_only"]
    assert all(hint.text.strip() for hint in hints)


# --------------------------------------------------------------------------------------
# Recording failure messages
# --------------------------------------------------------------------------------------


def _wrong_split_heads(x, num_heads):
    b, s, d = x.shape
    if d % num_heads:
        raise ValueError(f"D={d} is not divisible by H={num_heads}")
    return x.reshape(b, num_heads, s, d // num_heads)


def test_a_failing_check_records_its_message_once_and_a_passing_one_nothing(tmp_path, monkeypatch):
    from attention_lab.checks import mha_shapes

    monkeypatch.setenv(HINT_LOG_ENV_VAR, str(tmp_path))
    mha_shapes.check_merge_heads(lambda x: x.transpose(1, 2).flatten(2), device="cpu", quiet=True)
    assert hint_coverage.read_messages(tmp_path) == []
    with pytest.raises(CheckFailure) as failure:
        mha_shapes.check_split_heads(_wrong_split_heads, device="cpu", quiet=True)
    assert hint_coverage.read_messages(tmp_path) == [str(failure.value)]
    assert not hint_coverage.untriggered(
        [Hint("m.split_heads/k", "m", "SPLIT_HEADS_HINTS", "k", mha_shapes.SPLIT_HEADS_HINTS["reshape_only"])],
        hint_coverage.read_messages(tmp_path))


def test_failures_outside_a_check_are_recorded_too_and_nothing_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(HINT_LOG_ENV_VAR, raising=False)
    with pytest.raises(CheckFailure):
        expect_close(torch.ones(2), torch.zeros(2, dtype=torch.float64), what="f", against="g")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(HINT_LOG_ENV_VAR, str(tmp_path / "log"))
    with pytest.raises(CheckFailure) as failure:
        expect_close(torch.ones(2), torch.zeros(2, dtype=torch.float64), what="f", against="g")
    assert hint_coverage.read_messages(tmp_path / "log") == [str(failure.value)]


def test_each_process_records_into_a_file_of_its_own(tmp_path, monkeypatch):
    """pytest-xdist workers and notebook kernels write at the same time: one file per process."""
    monkeypatch.setenv(HINT_LOG_ENV_VAR, str(tmp_path))
    program = ("from attention_lab.checking import CheckFailure\n"
               "try:\n    raise CheckFailure('from the other process')\nexcept CheckFailure:\n    pass\n")
    subprocess.run([sys.executable, "-c", program], check=True, timeout=120)
    with pytest.raises(CheckFailure):
        raise CheckFailure("from this process")
    assert len(list(tmp_path.glob("failures-*.jsonl"))) == 2
    assert sorted(hint_coverage.read_messages(tmp_path)) == ["from the other process", "from this process"]


def test_the_session_log_variable_is_set_for_every_test():
    import os

    assert os.environ.get(HINT_LOG_ENV_VAR), "conftest should point the hint log at a folder for the session"


def test_a_whole_run_on_a_gpu_is_not_judged(monkeypatch, pytestconfig, tmp_path):
    # On a GPU (make gpu-check) the tests that need Triton's interpreter skip, so the hints only they reach cannot
    # appear: the gate failed a run whose every test passed.
    from tests.conftest import _judge_hint_coverage

    monkeypatch.setattr(hint_coverage, "whole_suite_ran", lambda option, args: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lines, fail = _judge_hint_coverage(pytestconfig, str(tmp_path))  # no message logged: every hint is missing
    assert not fail and "not judged (a CUDA GPU is here" in lines[0], lines
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines, fail = _judge_hint_coverage(pytestconfig, str(tmp_path))
    assert fail and lines[0].startswith("hint coverage FAILED"), lines
