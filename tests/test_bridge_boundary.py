"""What the student's code may do to the checker's objects, and what a lying kernel can buy: the bridge's
rules, tested in one process (tests/bridge_harness.py: the checker's side here, an agent in a thread).

* Check-owned objects stay the check's. A tensor, an array, a module (its parameters and buffers) or a
  course object (a configuration's fields) that a check gives the student's code comes back changed only
  where the call's contract says it writes it (``call_student(..., writes=...)``); every other change stays
  in the kernel, and the inputs-unchanged rule names it, in the lab and in grading alike.
* A lie costs one test. The from-scratch rules and the code-reading rules are decided from the submitted
  notebook's code, which the checker reads itself: a kernel whose course package reports "clean" (its
  tripwire disabled, its CodeFacts patched) fails them all the same, and the contradiction is noted for the
  report. Only an answer the cells do not define (built at run time) rests on the kernel's word.

The same attacks, graded by the real pipeline, are in tests/test_trust_boundary.py.
"""

from __future__ import annotations

import contextlib
import textwrap

import pytest
import torch
from torch import nn

import attention_lab.checks.mha_shapes as mha_checks
import attention_lab.checks.numpy_walkthrough as numpy_checks
from attention_lab.bridge.kernel_side import Agent
from attention_lab.checking import CheckFailure, RuleFailure, call_student
from attention_lab.checks.llama_attention import _Config
from attention_lab.checks.positions_and_blocks import _StandInEncoder
from tests.bridge_harness import bridged

WAYS = ["lab", "grading"]


@contextlib.contextmanager
def where(way: str, **answers):
    """The answers as the checks get them: themselves (the lab), or proxies through the bridge (grading)."""
    if way == "lab":
        yield answers, None
        return
    with bridged(dict(answers)) as bridge:
        yield bridge.lookup(list(answers)), bridge


# --------------------------------------------------------------------------------------
# Check-owned objects stay the check's
# --------------------------------------------------------------------------------------

class DropsQkNorm(nn.Module):
    """The attack of notebook 05: no QK norm, and a constructor that turns it off in the check's config."""

    def __init__(self, config):
        super().__init__()
        config.use_qk_norm = False
        self.config = config


class LooksFalse:
    """A look-alike value: equal to anything, false."""

    def __eq__(self, other):
        return True

    def __bool__(self):
        return False

    __hash__ = object.__hash__


class LookAlikeConfig(nn.Module):
    def __init__(self, config):
        super().__init__()
        config.use_qk_norm = LooksFalse()


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("answer, changed", [(DropsQkNorm, r"`use_qk_norm` True → False"),
                                             (LookAlikeConfig, r"`use_qk_norm` True → ")])
def test_a_config_the_answer_changes_fails_the_call_and_stays_the_checks(way, answer, changed):
    config = _Config()
    with where(way, answer=answer) as (found, _bridge):
        with pytest.raises(CheckFailure, match=rf"your `{answer.__name__}.__init__` changed the config it was "
                                               rf"given: {changed}"):
            call_student(found["answer"], config, call="answer(config)")
    if way == "grading":  # what the kernel did to its copy never reached the check's
        assert config == _Config()


def scales_the_encoder(encoder, coords):
    encoder.projection.mul_(2.0)  # a buffer of the check's module, changed in place
    return encoder(coords)


def replaces_the_buffer(encoder, coords):
    encoder.projection = torch.zeros_like(encoder.projection)
    return encoder(coords)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("answer", [scales_the_encoder, replaces_the_buffer])
def test_a_module_buffer_the_answer_changes_fails_the_call_and_stays_the_checks(way, answer):
    encoder = _StandInEncoder(3, torch.Generator().manual_seed(0))
    before = encoder.projection.clone()
    with where(way, answer=answer) as (found, _bridge):
        with pytest.raises(CheckFailure, match=r"changed the encoder it was given: its tensor `projection` changed"):
            call_student(found["answer"], encoder, torch.rand(4, 2, dtype=torch.float64), call="answer(encoder, coords)")
    if way == "grading":
        assert torch.equal(encoder.projection, before)


def copies_both_ways(target, source):
    """Writes its target (its contract), and its source too (which it may not)."""
    with torch.no_grad():
        target.weight.copy_(source.weight)
        source.weight.zero_()


def copies_into_its_target(target, source):
    with torch.no_grad():
        target.weight.copy_(source.weight)


@pytest.mark.parametrize("way", WAYS)
def test_state_crosses_back_only_into_the_arguments_the_contract_writes(way):
    source, target = nn.Linear(3, 2).double(), nn.Linear(3, 2).double()
    original = source.weight.detach().clone()
    with where(way, bad=copies_both_ways, good=copies_into_its_target) as (found, _bridge):
        with pytest.raises(CheckFailure, match=r"changed the source it was given: its tensor `weight` changed"):
            call_student(found["bad"], target, source, call="copy(target, source)", writes=("target",))
        if way == "grading":
            assert torch.equal(source.weight, original)
        with torch.no_grad():
            source.weight.copy_(original)
            target.weight.zero_()
        call_student(found["good"], target, source, call="copy(target, source)", writes=("target",))
    assert torch.equal(target.weight, original)  # the written argument holds what the call wrote, both ways


def accumulates(m, acc):
    acc.mul_(2.0)  # an accumulator updated in place and handed back, in its own position
    return m, acc


@pytest.mark.parametrize("way", WAYS)
def test_an_accumulator_handed_back_is_the_calls_to_write_and_reaches_the_check(way):
    m, acc = torch.zeros(2, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    with where(way, accumulates=accumulates) as (found, _bridge):
        _m, result = call_student(found["accumulates"], m, acc, call="step(m, acc)")
    assert torch.equal(result, torch.full((3,), 2.0, dtype=torch.float64))
    assert torch.equal(acc, torch.full((3,), 2.0 if way == "lab" else 1.0, dtype=torch.float64))


# --------------------------------------------------------------------------------------
# A lie costs one test
# --------------------------------------------------------------------------------------

class LyingAgent(Agent):
    """A kernel whose course package was rewritten to report every measurement clean: its tripwire saw
    no forbidden call and no in-place change; its reading of the answer's code found no shortcut, and a
    loop."""

    CLEAN = {"Tripwire": {"tripped": None, "in_place": []}, "CodeFacts": {"uses": [], "loops": True}}

    def answer(self, request, buffers):
        specs = request.get("probes", []) if request.get("op") == "call" else [request.get("probe")]
        with _clean_tripwires():
            reply, encoder = super().answer(request, buffers)
        for index, spec in enumerate(specs):
            clean = self.CLEAN.get(spec[1]) if isinstance(spec, list) and len(spec) == 3 else None
            if clean is not None and request.get("op") == "call":
                reply["probes"][index] = encoder.encode(clean)
            elif clean is not None and "findings" in reply:
                reply["findings"] = encoder.encode(clean)
        return reply, encoder


@contextlib.contextmanager
def _clean_tripwires():
    """The kernel's tripwire disabled (it runs in this process here: restored afterwards)."""
    from attention_lab import checking

    original = checking._TripwireMode.__torch_function__
    checking._TripwireMode.__torch_function__ = lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {}))
    try:
        yield
    finally:
        checking._TripwireMode.__torch_function__ = original


BUILT_IN_ATTENTION = """
import math
import torch
import torch.nn.functional as F

def attention_weights(q, k, mask=None):
    eye = torch.eye(k.shape[-2], dtype=q.dtype, device=q.device).expand(*k.shape[:-2], k.shape[-2], k.shape[-2])
    return F.scaled_dot_product_attention(q, k, eye, attn_mask=mask)
"""


def _defined(source: str) -> dict:
    namespace: dict = {}
    exec(compile(textwrap.dedent(source), "<cell>", "exec"), namespace)  # noqa: S102 -- the test's own answer
    return namespace


def test_a_kernel_that_reports_clean_fails_the_from_scratch_rule_read_from_its_code():
    namespace = _defined(BUILT_IN_ATTENTION)
    with bridged(namespace, code=[BUILT_IN_ATTENTION], agent=LyingAgent) as bridge:
        answer = bridge.lookup(["attention_weights"])["attention_weights"]
        with pytest.raises(RuleFailure, match=r"from-scratch exercise, but your code called the built-in "
                                              r"scaled_dot_product_attention\(\)"):
            mha_checks.check_attention_weights(answer)
        assert any("the kernel reported no call of scaled_dot_product_attention" in text and "F.scaled_dot_product"
                   in text for text in bridge.contradictions), bridge.contradictions


def test_what_a_lie_still_buys_an_answer_the_cells_do_not_define():
    """Built at run time, the answer is not in the cells: its from-scratch rule rests on the kernel's word,
    which a rewritten course package makes "clean" (the README says so)."""
    built = f"exec({textwrap.dedent(BUILT_IN_ATTENTION)!r})"
    namespace = _defined(BUILT_IN_ATTENTION)
    with bridged(namespace, code=[built], agent=LyingAgent) as bridge:
        mha_checks.check_attention_weights(bridge.lookup(["attention_weights"])["attention_weights"])
        assert bridge.contradictions == []
    with bridged(namespace, code=[built]) as bridge:  # the honest kernel's own tripwire catches it
        with pytest.raises(RuleFailure, match="from-scratch exercise"):
            mha_checks.check_attention_weights(bridge.lookup(["attention_weights"])["attention_weights"])


MATMUL_ROW = """
import numpy as np

def row_times_matrix(x_row, W):
    return np.asarray(x_row) @ np.asarray(W)
"""


def test_a_patched_code_reading_fails_the_shortcut_rule_read_from_the_code():
    namespace = _defined(MATMUL_ROW)
    with bridged(namespace, code=[MATMUL_ROW], agent=LyingAgent) as bridge:
        with pytest.raises(CheckFailure, match=r"calls @ \(in row_times_matrix, line \d+\)"):
            numpy_checks.check_row_times_matrix(bridge.lookup(["row_times_matrix"])["row_times_matrix"])
        assert any("the kernel read no @" in text for text in bridge.contradictions), bridge.contradictions


def test_the_checker_reads_answers_as_python_runs_them():
    """Names resolved through the cells' imports and aliases, helpers followed, the student's own function
    of a built-in's name and docstrings left alone, magics and cells that are not Python skipped."""
    from attention_lab.code_inspection import SubmittedCode

    code = SubmittedCode([
        "%matplotlib inline\nimport torch\nfrom torch.nn import functional as fn\nimport numpy as np\nmm = np.matmul",
        "this cell is not Python",
        "def scaled_dot_product_attention(q, k, v, mask=None):\n    '''Equals F.scaled_dot_product_attention.'''\n"
        "    return torch.softmax(q @ k.mT, -1) @ v",
        "class MultiHeadSelfAttention(torch.nn.Module):\n    def forward(self, x):\n"
        "        return scaled_dot_product_attention(x, x, x)",
        "def helper(q):\n    return fn.scaled_dot_product_attention(q, q, q)\ndef sneaky(q):\n    return helper(q)",
        "def by_name(q):\n    return getattr(fn, 'scaled_dot_product_attention')(q, q, q)",
        "def rows(x, W):\n    return [sum(a * b for a, b in zip(x, column)) for column in W.T] + [mm(x, W)]",
    ])
    forbidden = ("scaled_dot_product_attention", "multi_head_attention_forward")
    assert code.forbidden("scaled_dot_product_attention", forbidden) == []
    assert code.forbidden("MultiHeadSelfAttention", forbidden) == []
    assert [use.describe() for use in code.forbidden("sneaky", forbidden)] == [
        "fn.scaled_dot_product_attention (torch.nn.functional.scaled_dot_product_attention, in helper, line 2)"]
    assert len(code.forbidden("by_name", forbidden)) == 1
    assert [use.target for use in code.forbidden("scaled_dot_product_attention", numpy_only=True)][:1] == ["torch.softmax"]
    assert [use.describe() for use in code.uses("rows", functions=("numpy.matmul",))] == [
        "mm (numpy.matmul, in rows, line 2)"]
    assert code.loops("rows") and not code.loops("scaled_dot_product_attention")
    assert not code.knows("undefined") and code.knows("mm")


@pytest.mark.parametrize("way", WAYS)
def test_the_checks_given_objects_are_unchanged_by_an_honest_answer(way):
    """The rule costs an honest answer nothing: reading a config, a module and a course object's tensors."""
    def reads(encoder, config, x):
        return encoder(x) * (2.0 if config.use_qk_norm else 1.0)

    encoder = _StandInEncoder(3, torch.Generator().manual_seed(1))
    with where(way, reads=reads) as (found, _bridge):
        out = call_student(found["reads"], encoder, _Config(), torch.rand(2, 2, dtype=torch.float64),
                           call="reads(encoder, config, x)")
    assert out.shape == (2, 3)


# --------------------------------------------------------------------------------------
# Replies a kernel drips in, replies of 256 MiB
# --------------------------------------------------------------------------------------

def test_a_reply_that_drips_in_ends_the_test_at_its_limit_and_keeps_the_grader_out():
    """A rewritten agent sends a byte at a time, each well within the socket's timeout: the whole reply
    is due by the test's deadline (before, each read had the whole limit again: hours for one test), and
    the kernel is kept out of the notebook's later tests."""
    import socket
    import struct
    import threading
    import time

    from attention_lab.bridge import wire
    from attention_lab.bridge.checker_side import Bridge, BridgeError

    checker_end, kernel_end = socket.socketpair()

    def drip():
        wire.receive_frame(kernel_end)
        body = b'{"values": [{"value": ' + b"1" * 20_000 + b"}]}"
        with contextlib.suppress(OSError):
            for byte in b"ALB1" + struct.pack("<I", len(body)) + body + struct.pack("<I", 0):
                kernel_end.sendall(bytes([byte]))
                time.sleep(0.02)  # 400 s for the whole reply

    threading.Thread(target=drip, daemon=True).start()
    bridge = Bridge(checker_end, timeout=1.0)
    with pytest.raises(BridgeError, match="a little at a time"):
        bridge.lookup(["anything"])
    assert bridge.kept_out
    kernel_end.close()
    checker_end.close()


def test_a_received_tensor_owns_the_frames_memory_once():
    """The checker holds a 256 MiB reply once: the decoded tensor is the received buffer itself; a second
    value on the same buffer (which no agent sends) gets a copy, never the first one's memory."""
    import socket

    from attention_lab.bridge import wire

    sender, receiver = socket.socketpair()
    encoder = wire.Encoder(on_object=lambda obj: {})
    value = encoder.encode(torch.arange(1000, dtype=torch.float64))
    wire.send_frame(sender, {"value": value}, encoder.buffers)
    header, buffers = wire.receive_frame(receiver)
    decoder = wire.Decoder(buffers, on_tagged=lambda tag, fields: None)
    first, second = decoder.decode(header["value"]), decoder.decode(header["value"])
    assert torch.equal(first, torch.arange(1000, dtype=torch.float64)) and torch.equal(second, first)
    assert first.untyped_storage().data_ptr() == torch.frombuffer(buffers[0], dtype=torch.uint8).data_ptr()
    assert second.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    sender.close()
    receiver.close()
