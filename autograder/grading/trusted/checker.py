"""The trusted checker: where every graded test cell of a notebook under the trust boundary runs.

    python -m autograder.grading.trusted.checker     # requests on stdin, a JSON line each; answers on stdout

An nbgrader process (:mod:`autograder.grading.nbgrader_process`) keeps one checker for all its
students, next to their kernels, and sends it each graded test cell of a notebook listed in
:data:`autograder.grading.trusted.checker_client.CHECKED_OUTSIDE_THE_KERNEL`: the cell's source as nbgrader has it
(the source notebook's, with its hidden tests: never the student's copy), the submitted notebook's
code cells before it (data: the checks read an answer's code there themselves, so that a from-scratch
rule does not rest on the kernel's word), and the path of a socket.  The checker listens there, says
so, and the nbgrader process starts the bridge's agent in the student's kernel
(:func:`attention_lab.bridge.kernel_side.serve`), which connects.  The checker
then runs the test cell itself: the names the cell takes from the notebook are looked up in
the kernel (data, or proxies of the student's objects: :mod:`attention_lab.bridge.checker_side`),
the course's own checks run here, call the student's code through the bridge, and decide.
The answer is the cell's outputs, as a kernel would have produced them: what the checks
printed, and the error (its name, message and lines) when the test failed.

The student's code never runs in this process: nothing the kernel sends is executed,
imported or unpickled; the cell is the course's code.  So no code in a submission can change
how its own tests run: a transformer of later cells, a replaced check function, a fake check
module, a frame trick -- all of that lives in the kernel, which only answers with data.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import os
import select
import socket
import sys
import time
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attention_lab.bridge.checker_side import Bridge

MAX_OUTPUT = 20_000  # characters of printed output kept per test cell


def notebook_names(source: str) -> list[str]:
    """The names a test cell reads that it does not define itself (nor Python's builtins): what
    it takes from the notebook, in order of first use."""
    tree = ast.parse(source)
    bound, read = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in read:
            read.append(node.id)
    return [name for name in read if name not in bound and not hasattr(builtins, name)]


def _error_output(error: BaseException) -> dict:
    """The error output a kernel shows for ``error``: a CheckFailure as the student sees it in the
    lab (its message, wrapped), anything else as its name and message."""
    from attention_lab.checking import CheckFailure, wrapped_lines

    ename = type(error).__name__
    evalue = str(error)
    if isinstance(error, CheckFailure):
        lines = wrapped_lines(f"{ename}: {evalue}")
    else:
        lines = [f"{ename}: {evalue}"]
    return {"output_type": "error", "ename": ename, "evalue": evalue, "traceback": lines}


def run_cell(source: str, connection: socket.socket, timeout: float,
             code: list[str] | None = None) -> tuple[list[dict], Bridge]:
    """Run one test cell against the kernel at the other end of ``connection``: its outputs, and the bridge
    (how many requests crossed, where the kernel's measurements contradicted ``code`` -- the submitted
    notebook's code cells before this one, which the checks read themselves -- and whether it kept the
    grader out)."""
    from attention_lab.bridge.checker_side import Bridge
    from attention_lab.code_inspection import SubmittedCode

    bridge = Bridge(connection, timeout)
    if code is not None:
        bridge.submitted = SubmittedCode([cell for cell in code if isinstance(cell, str)])
    printed = io.StringIO()
    outputs: list[dict] = []
    try:
        with contextlib.redirect_stdout(printed):
            code = compile(source, "<test cell>", "exec")
            namespace = {"__name__": "__main__", "__builtins__": builtins}
            namespace.update(bridge.lookup(notebook_names(source)))
            exec(code, namespace)  # the course's test cell (never the student's code)
    except Exception as error:  # noqa: BLE001 -- a failed test, whatever it raised
        outputs.append(_error_output(error))
    finally:
        bridge.close()
    text = printed.getvalue()
    if len(text) > MAX_OUTPUT:
        text = text[:MAX_OUTPUT] + f"\n[output truncated by the grader after {MAX_OUTPUT} characters]\n"
    if text:
        outputs.insert(0, {"output_type": "stream", "name": "stdout", "text": text})
    return outputs, bridge


NOT_STARTED = "the kernel did not start the grader's bridge"


class Requests:
    """The nbgrader process's lines, read from the raw descriptor (no hidden buffer), so that the wait
    for a kernel's connection can watch for a cancel at the same time."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buffer = b""
        self.ended = False

    def read_more(self) -> bool:
        """One read of what is there; False once the nbgrader process closed the pipe."""
        chunk = os.read(self.fd, 1 << 16)
        self.buffer += chunk
        self.ended = not chunk
        return bool(chunk)

    def next_line(self) -> bytes | None:
        while b"\n" not in self.buffer:
            if self.ended or not self.read_more():
                return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    def take_cancel(self) -> bool:
        """Whether the next complete line is a cancel (taken, then, with any blank line before it)."""
        while b"\n" in self.buffer:
            line, rest = self.buffer.split(b"\n", 1)
            if line.strip() and "cancel" not in json.loads(line):
                return False
            self.buffer = rest
            if line.strip():
                return True
        return False


def wait_for_the_kernel(listener: socket.socket, requests: Requests, timeout: float) -> socket.socket | str:
    """The kernel's connection, or why there is none: it did not connect within ``timeout``, or the
    nbgrader process cancelled the wait -- the kernel had finished the agent's request without
    connecting (its cells are rewritten), so waiting longer would only cost time."""
    deadline = time.monotonic() + timeout
    while not requests.take_cancel():
        remaining = deadline - time.monotonic()
        if remaining <= 0 or requests.ended:
            return f"{NOT_STARTED} within {timeout:.0f} s"
        ready = select.select([listener, requests.fd], [], [], remaining)[0]
        if listener in ready:
            return listener.accept()[0]
        if ready:
            requests.read_more()
    return f"{NOT_STARTED}: it finished the grader's request without running it"


def serve() -> int:
    """Answer the nbgrader process's requests: ``{"cell", "socket", "timeout", "connect_timeout", "code"}`` ->
    ``{"listening": true}`` once the socket listens, then ``{"outputs": [...], "contradictions": [...],
    "kept_out": bool}`` (or ``{"error"}`` when the kernel never connected).  ``{"cancel": true}`` while the checker waits for the kernel
    ends that wait (the answer is the error); a cancel that comes later is ignored.  Answers go to
    what was standard output; anything else printed goes to standard error (the nbgrader
    process's log)."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    requests = Requests(sys.stdin.fileno())
    os.environ.setdefault("MPLBACKEND", "Agg")
    import torch  # once, before the first student

    # One thread, as each student's kernel has (autograder.isolation.sandbox.kernel_environment): the checker
    # runs next to the engine's kernels, and a second OpenMP thread on a busy 2-core machine made
    # every crossing's storage comparison (torch.equal, bridge/peer.py) wait on a descheduled
    # thread: 64 KiB compared in 4.5 ms instead of 0.12 ms, ~0.1 s per request of notebook 05.
    torch.set_num_threads(1)
    import attention_lab.checking  # noqa: F401
    from attention_lab.device import DEVICE_ENV_VAR

    # The checks run on the CPU, GPU or not: what the student's code returns crosses the boundary as CPU
    # tensors (and the sandbox's kernel has no GPU), so checks on CUDA would find every correct answer
    # "on cpu, not like its inputs". (A student's Triton kernel still runs natively where it was compiled.)
    os.environ[DEVICE_ENV_VAR] = "cpu"

    while (line := requests.next_line()) is not None:
        request = json.loads(line) if line.strip() else {}
        if "socket" not in request:  # a blank line, or a cancel that came after its answer
            continue
        path = request["socket"]
        listener = socket.socket(socket.AF_UNIX)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            listener.bind(path)
            listener.listen(1)
            answers.write(json.dumps({"listening": True}) + "\n")
            answers.flush()
            started = time.monotonic()
            connection = wait_for_the_kernel(listener, requests, float(request.get("connect_timeout", 60)))
            if isinstance(connection, str):
                answer = {"error": connection}
            else:
                outputs, bridge = run_cell(request["cell"], connection, float(request.get("timeout", 120)),
                                           request.get("code"))
                answer = {"outputs": outputs, "seconds": round(time.monotonic() - started, 3),
                          "requests": bridge.requests, "contradictions": bridge.contradictions,
                          "kept_out": bridge.kept_out}
        except Exception:  # a bug of ours: this cell cannot be graded, the next one can
            answer = {"error": "the checker failed: " + traceback.format_exc(limit=5)[-2000:]}
        finally:
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
