"""The check framework: what every ``check_<name>`` in ``attention_lab.checks`` is built from.

A check runs in layers and stops at the first failure, with a message a student can act on:

1. **Contract** -- callable, right parameters, returns a tensor/array of the exact shape,
   dtype and device (``[6]`` is not ``[1, 6]``).
2. **Numbers** -- against PyTorch itself or a mathematical identity, first in float64 on
   the CPU (the ground truth), then on the student's device and dtype with a tolerance
   chosen for them (:func:`tolerance`).
3. **Properties** with random sizes (causality, rows summing to 1, round trips, ...).
4. **Diagnosis** -- a wrong output is compared with known wrong variants (no 1/sqrt(d),
   softmax over the wrong axis, ...) and the likely mistake is named.

Every check runs inside :func:`check`'s wrapper, which

* refuses to run if the notebook replaced a library function the checks rely on
  (``torch.allclose = lambda *a: True``, ``F.scaled_dot_product_attention = mine``, ...):
  it restores the original and fails with a message saying so;
* pins the numerics (TF32 off, SDPA on the math backend) so CPU and CUDA give one verdict;
* prints one line on success;
* when it fails, checks quietly the student's earlier answers this exercise uses (``uses=``)
  and that the answer really called while the check ran (traced), and names any that fails
  its own check.

Every call of the student's code goes through :func:`call_student`, which

* turns an exception into a message that names the call (and, for float32 meeting float64,
  the keep-the-input's-dtype rule);
* fails an answer that changed one of its tensor or array inputs in place, naming the input
  and the in-place operation, before any number computed from that input is compared.

How precise an answer must be (what the student reads in the notebooks):

* An answer is compared with a float64 reference, within a tolerance that depends on the
  dtype it returns and the device it ran on (:func:`tolerance`): float32 answers get
  float32's tolerance, float64 answers float64's.
* Many good implementations compute in float32 inside even when given float64 input
  (``x.float() ... .type_as(x)``, a softmax in float32). Unless an exercise says otherwise,
  that is accepted: a float64 answer that is only float32-accurate passes, with a one-line
  note saying so. An exercise whose text asks to keep float64 throughout (``apply_rope``)
  fails such an answer, with a hint naming the downcast.
* Wrong answers (a missing scale, the wrong axis, ...) are off by 0.1 or more: far outside
  every tolerance, so this leniency never lets a mistake through.

Check modules are frozen with :func:`freeze_module`, so an answer cell cannot replace a
check either; test cells import the check they call, so rebinding the global name in the
notebook has no effect.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import json
import math
import numbers
import os
import sys
import sysconfig
import textwrap
import traceback
import types
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from attention_lab import code_inspection
from attention_lab.bridge import checker_side
from attention_lab.bridge.probes import Probe, in_the_kernel

__all__ = [
    "CheckFailure",
    "RuleFailure",
    "Variant",
    "check",
    "tolerance",
    "pinned_numerics",
    "math_sdpa_backend",
    "reference_sdpa",
    "describe",
    "shape_str",
    "wrapped_lines",
    "expect_callable",
    "expect_signature",
    "expect_tensor",
    "expect_array",
    "expect_close",
    "expect_true",
    "is_number",
    "is_integer",
    "expect_choice",
    "choice_digest",
    "expect_value_error",
    "add_note",
    "one_cpu_thread",
    "call_student",
    "from_scratch",
    "random_generator",
    "verify_untampered",
    "freeze_module",
    "diagnose",
    "describe_difference",
    "registered_checks",
    "HINT_LOG_ENV_VAR",
]


class CheckFailure(AssertionError):
    """A check found a problem in the student's answer. The message says what and why."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        _record_outside_checks(str(self))

    def _render_traceback_(self) -> list[str]:
        """How IPython (a notebook, nbgrader's Validate) shows this failure: the message, the
        notebook line that ran the check and, when the student's code raised, the frames of
        *their* code -- never the checks' own frames, which say nothing to a student.

        The line that ran the check also tells the grader's feedback whether the visible
        check or a hidden test failed.
        """
        frames = _student_frames(self.__traceback__) + _student_frames(self.__cause__ and self.__cause__.__traceback__)
        lines = []
        if frames:
            lines.append("In your notebook (most recent call last):")
            for frame in frames:
                lines.append("  " + _frame_location(frame))
                if frame.line:
                    lines.append("    " + frame.line.strip())
            lines.append("")
        return lines + wrapped_lines(f"{type(self).__name__}: {self}")


class RuleFailure(CheckFailure):
    """The answer's numbers may be right, but it breaks a rule of how the exercise asks to compute them (memory
    held at once, a built-in called, the work done, what kind of attribute holds a table). Such a failure cannot
    explain a wrong number in an exercise that uses the answer: the dependency notes of a failing check skip it."""


# Hints the framework itself gives (check modules keep theirs in dicts named *HINTS too).
HINTS = {
    "keep_dtype": "The rule of every notebook: an answer returns the dtype it was given (float64 in, "
                  "float64 out). The checks use float64 because it shows errors that float32 rounding "
                  "would hide. Do not call .float()/.double() on the result; compute in the input's dtype.",
    "mixed_dtype": "your code mixes float32 and float64 in one operation (a tensor or module made in "
                   "float32, e.g. `.float()`, `dtype=torch.float32`, `torch.tensor(...)` of Python floats "
                   "cast with `.float()`, or an nn.Linear/LayerNorm created inside forward). The rule of "
                   "every notebook: keep the input's dtype (the checks call your code in float64), so "
                   "create new tensors with dtype=x.dtype, device=x.device.",
    "input_changed": "{operation} changed {name} in place, and an answer that modified its input in place "
                     "breaks its caller, who still needs the original (this check compares your output with "
                     "the inputs it gave you). Compute a new tensor instead: `q = q * scale`, not `q *= scale`; "
                     "`masked_fill`, not `masked_fill_`.",
    "object_changed": "a function (or a class's __init__) that is given an object reads it and leaves it as "
                      "it was: its caller still uses it. Keep what you need in your own attributes "
                      "(`self.use_qk_norm = config.use_qk_norm`) and copy values into your own module "
                      "(`my_layer.weight.copy_(...)`), never into the {name} you were given.",
    "downcast": "your code computes in float32 somewhere (`.float()`, `dtype=torch.float32`, a float32 "
                "table ...) and casts back (`.type_as(x)`, `.to(x.dtype)`): that loses float64 precision. "
                "This exercise asks you to keep float64: compute in the input's dtype throughout.",
}


# --------------------------------------------------------------------------------------
# How a failure is shown in a notebook
# --------------------------------------------------------------------------------------

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Where installed libraries live (PyTorch's module wrappers, the standard library): their
# frames are not the student's code either.
_LIBRARY_DIRS = tuple({os.path.abspath(path) for key in ("stdlib", "platstdlib", "purelib", "platlib")
                       if (path := sysconfig.get_paths().get(key))})
# A failure's lines are wrapped here, at word boundaries, to this width: nbgrader's `validate` command cuts a
# line longer than 87 characters (its 4-space indent included), and JupyterLab's output area, which wraps a longer
# line again anywhere (word-break: break-all), holds 74 characters at 1024×768 with the file browser open
# (measured: 584 px of 7.83 px characters; tests/test_browser.py checks it). 72 leaves a margin for the scrollbar.
_LINE_WIDTH = 72


def _is_student_file(filename: str) -> bool:
    if filename.startswith("<"):  # <ipython-input-...>, <string>: code typed in a cell; not <frozen ...>
        return not filename.startswith("<frozen")
    path = os.path.abspath(filename)
    return not any(path == root or path.startswith(root + os.sep) for root in (_PACKAGE_DIR, *_LIBRARY_DIRS))


def _frame_location(frame: traceback.FrameSummary) -> str:
    """``Cell In[3], line 4, in split_heads`` for notebook cells, else the file and line."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        cell_number = shell.compile._filename_map.get(frame.filename) if shell is not None else None
    except Exception:  # no IPython, or one without this map: the file name will do
        cell_number = None
    where = f"Cell In[{cell_number}]" if cell_number is not None else f'File "{frame.filename}"'
    return f"{where}, line {frame.lineno}, in {frame.name}"


def _student_frames(trace: types.TracebackType | None) -> list[traceback.FrameSummary]:
    """The frames of ``trace`` in the student's own code (notebook cells, their modules)."""
    if trace is None:
        return []
    return [frame for frame in traceback.extract_tb(trace) if _is_student_file(frame.filename)]


def wrapped_lines(text: str) -> list[str]:
    """Lines of at most _LINE_WIDTH characters, as a failure is shown (in the lab, and by the grader's
    checker); a continuation keeps its line's indent, plus two."""
    lines = []
    for line in text.splitlines() or [""]:
        indent = line[: len(line) - len(line.lstrip())]
        lines += textwrap.wrap(line, _LINE_WIDTH, subsequent_indent=indent + "  ", break_long_words=False,
                               break_on_hyphens=False) or [""]
    return lines


# --------------------------------------------------------------------------------------
# Describing things in messages
# --------------------------------------------------------------------------------------


def shape_str(shape: Iterable[int]) -> str:
    """``[2, 4, 5, 8]``: shapes are written the way the notebooks write them."""
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def describe(value: Any) -> str:
    """A short description of a value for messages: shape, dtype and device of a tensor."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"tensor of shape {shape_str(value.shape)} ({dtype}, {value.device.type})"
    if isinstance(value, np.ndarray):
        return f"ndarray of shape {shape_str(value.shape)} ({value.dtype})"
    if isinstance(value, tuple):
        return "tuple of " + str(len(value)) + " (" + ", ".join(describe(v) for v in value) + ")"
    if value is None:
        return "None"
    if checker_side.is_remote(value):  # a proxy's own words (its class is the course's, not the student's)
        return repr(value)[:120]
    return f"{type(value).__name__} {value!r}"[:120]


# --------------------------------------------------------------------------------------
# Tolerances and pinned numerics
# --------------------------------------------------------------------------------------

# (rtol, atol) for comparing a student's output in `dtype` with a float64 reference.
# The references are exact to ~1e-15; these budgets cover the rounding of the student's
# dtype over the small sizes the checks use (reductions of at most a few hundred terms).
# Wrong answers (missing scale, wrong axis, ...) are off by 1e-1 or more, far outside.
_TOLERANCES: dict[tuple[torch.dtype, str], tuple[float, float]] = {
    (torch.float64, "cpu"): (1e-7, 1e-9),
    (torch.float64, "cuda"): (1e-7, 1e-9),
    (torch.float32, "cpu"): (1e-4, 1e-5),
    # CUDA float32 with TF32 off: different summation order and fused kernels.
    (torch.float32, "cuda"): (1e-4, 5e-5),
    (torch.float16, "cpu"): (1e-2, 2e-3),
    (torch.float16, "cuda"): (1e-2, 2e-3),
    (torch.bfloat16, "cpu"): (3e-2, 2e-2),
    (torch.bfloat16, "cuda"): (3e-2, 2e-2),
}


def tolerance(dtype: torch.dtype | np.dtype, device: torch.device | str = "cpu") -> tuple[float, float]:
    """``(rtol, atol)`` for an output computed in ``dtype`` on ``device``.

    NumPy dtypes are accepted (``np.float64`` is treated like ``torch.float64``); a complex
    dtype gets the tolerance of its real and imaginary parts.
    """
    if not isinstance(dtype, torch.dtype):
        dtype = {np.dtype("float64"): torch.float64, np.dtype("float32"): torch.float32,
                 np.dtype("float16"): torch.float16, np.dtype("complex128"): torch.float64,
                 np.dtype("complex64"): torch.float32}.get(np.dtype(dtype), torch.float64)
    dtype = {torch.complex128: torch.float64, torch.complex64: torch.float32}.get(dtype, dtype)  # per component
    device_type = torch.device(device).type
    device_type = device_type if device_type in ("cpu", "cuda") else "cuda"
    try:
        return _TOLERANCES[(dtype, device_type)]
    except KeyError:
        raise ValueError(f"no tolerance is defined for dtype {dtype} on {device_type}") from None


@contextlib.contextmanager
def pinned_numerics() -> Iterator[None]:
    """Make CPU and CUDA give the same verdict: TF32 off, full-precision float32 matmul.

    On Ampere and newer GPUs PyTorch may run float32 matmuls in TF32 (10-bit mantissa),
    which is off by ~1e-3 -- enough to fail a correct answer or pass a wrong one. The
    previous settings are restored on exit, so a notebook's own speed settings survive.
    """
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.backends.cudnn.allow_tf32 = saved[1]
        torch.set_float32_matmul_precision(saved[2])


@contextlib.contextmanager
def one_cpu_thread(device: torch.device | str) -> Iterator[None]:
    """Train tiny models on one CPU thread: as fast as two at these sizes, and immune to the
    thread oversubscription of a grading machine that runs several notebooks at once."""
    if torch.device(device).type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextlib.contextmanager
def math_sdpa_backend() -> Iterator[None]:
    """Run ``F.scaled_dot_product_attention`` on its math backend: the same kernel on every device.

    The flash and memory-efficient kernels (chosen automatically on CUDA) are accurate to
    their own, looser tolerance and do not support float64; pinning the math backend makes
    the reference identical in meaning on CPU and CUDA.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def reference_sdpa(q, k, v, attn_mask=None, **kwargs) -> torch.Tensor:
    """PyTorch's own attention (the untampered original) on the math backend."""
    with math_sdpa_backend():
        return _PRISTINE_SDPA(q, k, v, attn_mask=attn_mask, **kwargs)


_PRISTINE_SDPA = F.scaled_dot_product_attention


# --------------------------------------------------------------------------------------
# Tamper protection: the notebook must not replace what the checks rely on
# --------------------------------------------------------------------------------------

# Namespaces whose callables are snapshotted when the package is imported (by the setup
# cell, before any answer cell runs). Replacing one of them in a notebook -- on purpose
# or by accident -- would let a wrong answer pass, since the references use them too.
_WATCHED_NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("torch", torch),
    ("torch.Tensor", torch.Tensor),
    ("torch.nn.functional", F),
    ("torch.testing", torch.testing),
    ("torch.linalg", torch.linalg),
    ("numpy", np),
    ("numpy.testing", np.testing),
    ("numpy.linalg", np.linalg),
    ("math", math),
)
# The kernel swaps some builtins per cell (input, getpass); watch only those checks use.
_WATCHED_BUILTINS = ("abs", "all", "any", "callable", "float", "getattr", "int", "isinstance",
                     "len", "max", "min", "range", "round", "sorted", "sum", "tuple", "zip")
_WATCHED_MODULE_CLASSES = (
    torch.nn.Linear,
    torch.nn.LayerNorm,
    torch.nn.MultiheadAttention,
    torch.nn.TransformerEncoderLayer,
    torch.nn.Conv2d,
    torch.nn.Module,
)


def _watched_items() -> Iterator[tuple[Any, str, Any]]:
    for _label, namespace in _WATCHED_NAMESPACES:
        is_class = isinstance(namespace, type)
        for attr, obj in list(vars(namespace).items()):
            if isinstance(obj, types.ModuleType) or (attr.startswith("__") and not is_class):
                continue
            if callable(obj) or isinstance(obj, (staticmethod, classmethod)):
                yield namespace, attr, obj
    for attr in _WATCHED_BUILTINS:
        yield builtins, attr, vars(builtins)[attr]
    for cls in _WATCHED_MODULE_CLASSES:
        for attr in ("forward", "__call__", "_call_impl"):
            if attr in vars(cls):
                yield cls, attr, vars(cls)[attr]


_SNAPSHOT: list[tuple[Any, str, Any]] = list(_watched_items())
# PyTorch itself rewraps these when it first imports torch._dynamo (e.g. on the first
# optimizer step): a wrapper of the original is expected, not tampering. No check relies on
# them for a verdict.
_LAZILY_REWRAPPED = {(torch, "manual_seed")}
# Classes whose namespace must not grow: `torch.Tensor.__sub__ = ...` adds an override
# to the Python class (the original lives on the C base class), so it is a new key.
_CLASS_KEYS: dict[type, frozenset[str]] = {
    cls: frozenset(vars(cls)) for cls in (torch.Tensor, *_WATCHED_MODULE_CLASSES)
}


def _label(namespace: Any) -> str:
    if isinstance(namespace, types.ModuleType):
        return namespace.__name__
    return f"{namespace.__module__}.{namespace.__qualname__}"


def verify_untampered() -> None:
    """Fail if the notebook replaced a library function; put the original back first."""
    replaced = []
    for index, (namespace, attr, original) in enumerate(_SNAPSHOT):
        current = vars(namespace).get(attr, _MISSING)
        if current is original:
            continue
        if (namespace, attr) in _LAZILY_REWRAPPED and getattr(current, "__wrapped__", None) is original:
            _SNAPSHOT[index] = (namespace, attr, current)  # PyTorch's own wrapper: expect it from now on
            continue
        setattr(namespace, attr, original)
        replaced.append(f"{_label(namespace)}.{attr}")
    for cls, keys in _CLASS_KEYS.items():
        for attr in set(vars(cls)) - keys:
            delattr(cls, attr)
            replaced.append(f"{_label(cls)}.{attr}")
    if replaced:
        raise CheckFailure(
            "Your notebook replaced library functions that the checks rely on: "
            + ", ".join(sorted(replaced))
            + ". The originals have been restored. Remove the line that assigns to them "
            "(e.g. `torch.allclose = ...`) and run the notebook again."
        )


_MISSING = object()


class _FrozenModule(types.ModuleType):
    """A module whose public names cannot be rebound after it was loaded."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__") and name.endswith("__"):
            super().__setattr__(name, value)
            return
        raise AttributeError(
            f"{self.__name__}.{name} is read-only: the course's checks cannot be replaced."
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{self.__name__}.{name} is read-only: the course's checks cannot be removed.")


def freeze_module(module_name: str) -> None:
    """Make the public names of a loaded module read-only (called at the end of each check module).

    Its submodules can still be imported, since importing sets them on the parent.
    """
    module = sys.modules[module_name]
    module.__class__ = _FrozenModule


# --------------------------------------------------------------------------------------
# The "from scratch" guard
# --------------------------------------------------------------------------------------


def _torch_function_name(func: Any) -> str:
    module = getattr(func, "__module__", None) or ""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return f"{module}.{name}" if module else name


def _torch_function_short_name(func: Any) -> str:
    """The last part of :func:`_torch_function_name` (``add_`` for ``Tensor.add_``), without building
    the full name."""
    qualified = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    return qualified.rpartition(".")[2] if qualified else _torch_function_name(func).rsplit(".", 1)[-1]


class Tripwire(Probe):
    """Watches one call of the student's code: the first forbidden PyTorch function it calls (any
    torch function, with ``numpy_only``) and the first in-place operation on each of the
    ``watched`` tensors (its inputs). A forbidden call is recorded and raises at once; the check
    reads :attr:`tripped` after the call, so an answer that catches that exception still fails."""

    def __init__(self, forbidden: Sequence[str] = (), exercise: str = "", numpy_only: bool = False,
                 watched: Sequence[torch.Tensor] = ()):
        super().__init__(forbidden=list(forbidden), exercise=exercise, numpy_only=bool(numpy_only),
                         watched=list(watched))
        self.forbidden = tuple(forbidden)
        self.exercise = exercise
        self.numpy_only = bool(numpy_only)
        self.watched = {key: index for index, tensor in enumerate(watched)
                        if (key := _storage_key(tensor)) is not None}
        self.tripped: tuple[str, str] | None = None  # (the function's full name, its short name)
        self.in_place: dict[int, str] = {}  # index in watched -> first in-place operation on it
        self._mode: _TripwireMode | None = None

    def __enter__(self) -> "Tripwire":
        # Nothing forbidden and no input to watch: a torch function mode would see every operation
        # of the call (a whole training run, for a loop) and record nothing; it doubles the time of a
        # training check.
        if self.forbidden or self.numpy_only or self.watched:
            self._mode = _TripwireMode(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None

    def findings(self) -> dict:
        return {"tripped": list(self.tripped) if self.tripped else None,
                "in_place": [[index, operation] for index, operation in self.in_place.items()]}

    def accept(self, findings: Any) -> None:
        tripped = findings.get("tripped") if isinstance(findings, dict) else None
        if isinstance(tripped, list) and len(tripped) == 2 and all(isinstance(t, str) and len(t) < 300 for t in tripped) \
                and (self.numpy_only or tripped[1] in self.forbidden):
            self.tripped = (tripped[0], tripped[1])
        in_place = findings.get("in_place") if isinstance(findings, dict) else None
        for item in in_place if isinstance(in_place, list) else ():
            if isinstance(item, list) and len(item) == 2 and type(item[0]) is int and isinstance(item[1], str):
                self.in_place.setdefault(item[0], item[1][:100])

    def failure(self) -> "RuleFailure | None":
        """The failure a forbidden call earns (a rule, not a number: see RuleFailure), or None."""
        if self.tripped is None:
            return None
        name, short = self.tripped
        if self.numpy_only:
            return RuleFailure(
                f"{self.exercise} must be written with NumPy only, but your code called "
                f"torch ({name}). Convert nothing to torch: use np.* functions and the @ operator.")
        return RuleFailure(
            f"{self.exercise} is a from-scratch exercise, but your code called the built-in "
            f"{short}() that it is compared with. Write it with ordinary tensor operations "
            f"(matmul, softmax, masked_fill, ...).")

    def _record_in_place(self, short: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        writes_first = (short.endswith("_") and not short.startswith("_")) or short == "__setitem__"
        out = kwargs.get("out")
        if not writes_first and out is None:  # most operations: nothing written in place
            return
        targets = []
        if writes_first:
            targets.append((args[0] if args else None, short))
        for tensor in (out if isinstance(out, (tuple, list)) else (out,)):
            targets.append((tensor, f"out={short}"))
        for tensor, operation in targets:
            if isinstance(tensor, torch.Tensor):
                index = self.watched.get(_storage_key(tensor))
                if index is not None:
                    self.in_place.setdefault(index, operation)


class _TripwireMode(TorchFunctionMode):
    """The torch function mode a :class:`Tripwire` watches through."""

    def __init__(self, tripwire: Tripwire):
        super().__init__()
        self.tripwire = tripwire

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Runs for every operation of the call (a training loop's included): the full name is only
        # built for a forbidden call.
        kwargs = kwargs or {}
        tripwire = self.tripwire
        short = _torch_function_short_name(func)
        if tripwire.watched:
            tripwire._record_in_place(short, args, kwargs)
        if tripwire.numpy_only or short in tripwire.forbidden:
            tripwire.tripped = tripwire.tripped or (_torch_function_name(func), short)
            raise tripwire.failure()
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------
# Watching every PyTorch call of an answer (06's and 07's memory and work rules)
# --------------------------------------------------------------------------------------

# Frames that are not the student's: PyTorch, the course package, the machinery between them.
_NOT_STUDENT_FILES = ("/torch/", "/attention_lab/", "contextlib.py", "<frozen", "/site-packages/")


def student_line() -> str:
    """` (your line: `source`)` for the innermost frame of the student's code (not torch, not the checks)."""
    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in _NOT_STUDENT_FILES):
            text = (frame.line or "").strip()
            return f" (your line: `{text}`)" if text else ""
    return ""


class FunctionWatch(Probe):
    """A probe that sees every PyTorch function the student's code calls and what it returns, through a
    torch function mode entered around the call where it runs (in grading: in the student's kernel, and
    what it kept comes back as data). A function mode (not a dispatch mode) sees the calls as written --
    ``q @ k.mT``, ``torch.einsum`` -- and costs no import of the compiler stack. A subclass keeps what its
    rule needs in :meth:`saw`."""

    def __enter__(self) -> "FunctionWatch":
        self._mode = _FunctionWatchMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    @in_the_kernel
    def saw(self, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
            new_outputs: list[torch.Tensor]) -> None:
        """One call that returned tensors: the function's name, the tensors it was given, those it returned,
        and of those the new ones (not a view of an input: an expand, a slice or a view has no memory of
        its own)."""
        raise NotImplementedError


class _FunctionWatchMode(TorchFunctionMode):
    """The torch function mode a :class:`FunctionWatch` watches through."""

    def __init__(self, watch: FunctionWatch):
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outputs:
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            input_storages = {_storage_key(t) for t in inputs}
            self.watch.saw(str(getattr(func, "__name__", func)), inputs, outputs,
                           [t for t in outputs if _storage_key(t) not in input_storages])
        return out


@contextlib.contextmanager
def from_scratch(exercise: str, forbidden: Sequence[str] = (), numpy_only: bool = False) -> Iterator[None]:
    """Inside this block, calling a forbidden built-in (or, with ``numpy_only``, any torch
    function) raises a :class:`CheckFailure` that names it.

    nn.MultiheadAttention calls ``multi_head_attention_forward``; nn.RMSNorm calls
    ``rms_norm``: forbidding the functional form catches the module form too.
    """
    with Tripwire(forbidden, exercise, numpy_only):
        yield


# --------------------------------------------------------------------------------------
# Calling the student's code
# --------------------------------------------------------------------------------------


def _argument_names(fn: Callable, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(name, value) of every argument of a call, named as ``fn``'s signature names them."""
    try:  # a module is called through forward: its parameters name the arguments
        signature = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
        bound = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return [(f"argument {index + 1}", value) for index, value in enumerate(args)] + list(kwargs.items())
    named = []
    for name, value in bound.items():
        kind = signature.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            named += [(f"{name}[{index}]", item) for index, item in enumerate(value)]
        elif kind == inspect.Parameter.VAR_KEYWORD:
            named += list(value.items())
        else:
            named.append((name, value))
    return named


def _is_course_object(value: Any) -> bool:
    """An object of one of the course's own classes (a check's configuration, its reference cache), not
    a module, tensor, class or proxy: what the bridge sends as its fields."""
    module = type(value).__module__ or ""
    return (module.startswith("attention_lab.") and not module.startswith("attention_lab.bridge")
            and not isinstance(value, (type, torch.Tensor, np.ndarray, torch.nn.Module))
            and isinstance(getattr(value, "__dict__", None), dict))


def _copied(value: Any) -> Any:
    """A copy of a field's value to compare with later (tensors and arrays by value)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if value.layout == torch.strided and not value.is_meta else value
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


def _module_tensors(module: torch.nn.Module, left: checker_side.LeftBehind | None = None) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by its qualified name (``proj.weight``); with ``left``, as
    the student's kernel left them (a module of the checker's own, in grading)."""
    found = {}

    def walk(current: torch.nn.Module, prefix: str, depth: int) -> None:
        current = left.module(current) if left is not None else current
        for kind in (current._parameters, current._buffers):
            for name, tensor in kind.items():
                if tensor is not None:
                    found[prefix + name] = left.tensor(tensor) if left is not None else tensor
        for name, child in current._modules.items():
            if child is not None and depth < 16:
                walk(child, f"{prefix}{name}.", depth + 1)

    walk(module, "", 0)
    return found


def _input_snapshots(fn: Callable, args: Sequence[Any], kwargs: Mapping[str, Any],
                     writes: Sequence[str] = ()) -> list[tuple[str, Any, Any]]:
    """(name, the argument, a copy of it) for every input the call must leave as it was: each tensor or
    ndarray argument, or one inside a tuple or list argument (``x``, ``attentions[1]``); each module's
    parameters and buffers; each course object's fields. Arguments named in ``writes`` are left out:
    the exercise's contract says the call writes them."""
    snapshots = []
    for name, value in _argument_names(fn, args, kwargs):
        if name in writes:
            continue
        items = [(f"{name}[{index}]", item) for index, item in enumerate(value)] \
            if type(value) in (tuple, list) else [(name, value)]
        for item_name, item in items:
            if isinstance(item, torch.Tensor) and item.layout == torch.strided and not item.is_meta:
                snapshots.append((item_name, item, item.detach().clone()))
            elif isinstance(item, np.ndarray):
                snapshots.append((item_name, item, item.copy()))
            elif isinstance(item, torch.nn.Module):
                snapshots.append((item_name, item, {k: _copied(t) for k, t in _module_tensors(item).items()}))
            elif _is_course_object(item):
                snapshots.append((item_name, item, {"__class__": type(item), **{k: _copied(v) for k, v in vars(item).items()}}))
    return snapshots


def _unchanged(current: Any, before: Any) -> bool:
    if isinstance(current, np.ndarray):
        return isinstance(before, np.ndarray) and current.shape == before.shape and current.dtype == before.dtype \
            and bool(np.array_equal(current, before, equal_nan=current.dtype.kind in "fc"))
    if isinstance(current, torch.Tensor):
        if not isinstance(before, torch.Tensor):
            return False
        current = current.detach()
        if current.shape != before.shape or current.dtype != before.dtype:
            return False
        if current.is_floating_point() or current.is_complex():
            return bool(((current == before) | (torch.isnan(current) & torch.isnan(before))).all())
        return bool(torch.equal(current, before))
    if isinstance(before, (torch.Tensor, np.ndarray)) or type(current) is not type(before):
        return False  # (a look-alike of another class is another value, whatever its == says)
    try:
        return current is before or bool(before == current)
    except Exception:  # a value whose == raises or is not a truth value: not the same
        return False


def _after(value: Any, left: checker_side.LeftBehind | None) -> Any:
    """An input as the call left it, in the form its snapshot has: in grading, as the student's kernel
    left the checker's object (``left``; the object itself is unchanged)."""
    if isinstance(value, torch.Tensor):
        return left.tensor(value) if left is not None else value
    if isinstance(value, np.ndarray):
        return left.array(value) if left is not None else value
    if isinstance(value, torch.nn.Module):
        return _module_tensors(value, left)
    fields = left.fields(value) if left is not None else None
    return {"__class__": type(value), **(vars(value) if fields is None else fields)}


def _changed_parts(current: dict, before: dict) -> list[tuple[str, Any, Any]]:
    """(name, before, after) of each field or tensor that differs (MISSING where there is none)."""
    return [(name, before.get(name, _MISSING), current.get(name, _MISSING)) for name in [*before, *current]
            if name in before and (name not in current or not _unchanged(current[name], before[name]))
            or name not in before]


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(none)"
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return describe(value)
    return repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."


def _who(fn: Callable) -> str:
    """How a message names the student's code that ran: ``LlamaAttention.__init__``, ``MultiHeadSelfAttention.forward``,
    ``load_torch_mha_weights``."""
    if isinstance(fn, type):
        return f"{fn.__name__}.__init__"
    if isinstance(fn, torch.nn.Module):
        return f"{type(fn).__name__}.forward"
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _expect_objects_unchanged(snapshots: Sequence[tuple[str, Any, Any]], call: str, fn: Callable,
                              left: checker_side.LeftBehind | None) -> None:
    """Fail, naming what changed, when the call changed a module or course object it was given."""
    for name, value, before in snapshots:
        if not isinstance(before, dict):
            continue
        changed = _changed_parts(_after(value, left), before)
        if not changed:
            continue
        part, old, new = changed[0]
        if isinstance(value, torch.nn.Module):
            what = f"its {'parameter or buffer' if old is _MISSING or new is _MISSING else 'tensor'} `{part}`"
            detail = f"{what} ({_show(old)} → {_show(new)})" if old is _MISSING or new is _MISSING else f"{what} changed"
        else:
            detail = f"`{part}` {_show(old)} → {_show(new)}"
        others = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise CheckFailure(f"{call}: your `{_who(fn)}` changed the {name} it was given: {detail}{others}.\n"
                           f"  Likely mistake: {HINTS['object_changed'].format(name=name)}")


# How an in-place tensor operation reads in a message (``q *= s`` reaches PyTorch as ``mul_``).
_IN_PLACE_SPELLING = {
    "mul_": "`{name} *= ...` (or `{name}.mul_(...)`)",
    "add_": "`{name} += ...` (or `{name}.add_(...)`)",
    "sub_": "`{name} -= ...` (or `{name}.sub_(...)`)",
    "div_": "`{name} /= ...` (or `{name}.div_(...)`)",
    "__setitem__": "`{name}[...] = ...`",
}


def _in_place_operation(name: str, operation: str | None, is_array: bool) -> str:
    if operation is None:
        if is_array:
            return f"An in-place operation (`{name} -= ...`, `{name} *= ...`, `np.exp({name}, out={name})`, `{name}[...] = ...`)"
        return f"An in-place operation (`{name} *= ...`, `{name}.mul_(...)`, `{name}.masked_fill_(...)`, `{name}[...] = ...`)"
    if operation.startswith("out="):
        return f"`out={name}` in {operation[4:]}(...)"
    return _IN_PLACE_SPELLING.get(operation, f"`{name}.{operation}(...)`").format(name=name)


def _same_memory(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _storage_key(a) is not None and _storage_key(a) == _storage_key(b)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.shares_memory(a, b))
    return False


def _handed_back(args: Sequence[Any], result: Any, left: checker_side.LeftBehind | None = None) -> set[int]:
    """Positions i where the answer returned its i-th argument (its memory) as the i-th element of its
    result, a tuple: an accumulator updated in place and handed back (``acc.mul_(alpha); return m, l, acc``).
    Whether that is allowed is the exercise's contract, so the exercise's own check decides. (In
    grading the memory the answer wrote is the kernel's copy of the argument's: ``left``.)"""
    if not isinstance(result, (tuple, list)):
        return set()  # one tensor returned: not an accumulator (``x.mul_(2); return x`` changed the caller's x)
    return {i for i, (argument, value) in enumerate(zip(args, result))
            if _same_memory(_after(argument, left) if isinstance(argument, (torch.Tensor, np.ndarray)) else argument,
                            value)}


def _expect_inputs_unchanged(snapshots: Sequence[tuple[str, Any, Any]], in_place: Mapping[int, str], call: str,
                             handed_back: Sequence[Any] = (), left: checker_side.LeftBehind | None = None) -> None:
    """Fail, naming the argument and the in-place operation, when the call changed one of its tensor or
    array inputs (other than those in ``handed_back``; ``left``: what it left of them, in grading)."""
    for name, argument, before in snapshots:
        if isinstance(before, dict):
            continue  # a module or a course object: _expect_objects_unchanged
        current = _after(argument, left)
        if _unchanged(current, before) or any(argument is value for value in handed_back):
            continue
        operation = None
        if isinstance(current, torch.Tensor):
            operation = in_place.get(_storage_key(argument))
        spelled = _in_place_operation(name.split("[")[0] if operation is None else name, operation,
                                      isinstance(current, np.ndarray))
        raise CheckFailure(f"{call}: your code changed its input {name} in place, so the caller's {name} is no "
                           f"longer what it passed.\n  Likely mistake: "
                           + HINTS["input_changed"].format(operation=spelled, name=name))


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # a tensor without storage (meta, a functional wrapper)
        return None


def _is_mixed_dtype_error(error: BaseException) -> bool:
    """PyTorch's complaint about float32 meeting float64 in one operation."""
    text = str(error).lower()
    if not isinstance(error, RuntimeError):
        return False
    if "mixed dtype" in text or "expected scalar type" in text:
        return True
    return ("dtype" in text or "scalar type" in text) and any(
        word in text for word in ("double", "float64")) and any(word in text for word in ("float", "half"))


def _probes_failure(tripwire: "Tripwire", probes: Sequence[Probe], fn: Any = None) -> "CheckFailure | None":
    """The failure the call's measurements earn; in grading the from-scratch rule is also decided from the
    submitted code itself (:func:`_source_failure`), whatever the kernel's tripwire reported."""
    if (failure := tripwire.failure()) is not None or (failure := _source_failure(fn, tripwire)) is not None:
        return failure
    return next((failure for probe in probes if (failure := probe.failure()) is not None), None)


def _source_failure(fn: Any, tripwire: "Tripwire") -> "RuleFailure | None":
    """In grading, a forbidden built-in named in the answer's submitted code (or its helpers') fails the
    from-scratch rule as a call of it would; a kernel whose tripwire saw nothing is noted for the report."""
    if fn is None or not (tripwire.forbidden or tripwire.numpy_only) or not checker_side.is_remote(fn):
        return None
    found = code_inspection.forbidden_in_source(fn, tripwire.forbidden, tripwire.numpy_only)
    if not found:
        return None
    use = found[0]
    last = use.target.rsplit(".", 1)[-1]
    short = next((name for name in tripwire.forbidden if last in (name, *code_inspection.MODULE_FORMS.get(name, ()))),
                 last)
    checker_side.contradiction(fn, f"{tripwire.exercise}: the kernel reported no call of {short}, but the submitted code "
                             f"names it: {use.describe()}")
    tripwire.tripped = (use.target, short)
    return tripwire.failure()


def crash_message(call: str, error: BaseException) -> str:
    """How a call that ended in ``error`` reads in a failure: ``{call} raised ValueError: text`` for
    an exception of the student's code; for a failure of their kernel (a ``checker_side.BridgeError``: a
    timeout, a malformed answer, never an exception of their code) the kernel's own words,
    ``{call}: text``, with no class name of the course's in them."""
    if isinstance(error, checker_side.BridgeError):
        return f"{call}: {error}"
    return f"{call} raised {type(error).__name__}: {error}"


def call_student(
    fn: Callable,
    *args: Any,
    call: str,
    forbidden: Sequence[str] = (),
    numpy_only: bool = False,
    inputs_unchanged: bool = True,
    probes: Sequence[Probe] = (),
    writes: Sequence[str] = (),
    **kwargs: Any,
) -> Any:
    """Call the student's ``fn``; turn any exception into a message that names the call.

    ``call`` is how the call reads in the message, e.g. ``"split_heads(x, num_heads=4)
    with x of shape [2, 5, 32]"``.

    With ``inputs_unchanged`` (the default), a call that changes one of its tensor or ndarray
    arguments (or one inside a tuple or list argument) in place fails, naming the argument and the
    in-place operation -- before any check compares numbers computed from inputs that are no longer
    what they were; so does one that changes a module it was given (its parameters or buffers) or an
    object of the course's (a configuration's fields), naming what changed. Two exceptions: the
    arguments named in ``writes``, which the exercise's contract says the call writes (the module
    ``load_torch_mha_weights`` loads); and an argument updated in place and returned in its own position
    (an accumulator, ``f(m, l, acc) -> (m, l, acc)``), left to the exercise's own check, which knows
    whether its contract allows that. In grading the student's changes reach only the ``writes``
    arguments: of every other object of the check's, the check keeps its own. A crash from mixing
    float32 and float64 names the keep-the-input's-dtype rule.

    ``probes`` (:class:`attention_lab.bridge.probes.Probe`) measure the call where it runs: here in
    the lab, in the student's kernel when grading calls a proxy of their code.
    """
    exercise = getattr(fn, "__name__", None) or type(fn).__name__
    snapshots = _input_snapshots(fn, args, kwargs, writes) if inputs_unchanged else []
    watched = [tensor for _, tensor, _ in snapshots if isinstance(tensor, torch.Tensor)]
    tripwire = Tripwire(forbidden, exercise, numpy_only, watched)
    written = [value for name, value in _argument_names(fn, args, kwargs) if name in writes]
    try:
        if checker_side.is_remote(fn):  # grading: the call runs in the student's kernel, the tripwire with it
            result = checker_side.remote_call(fn, args, kwargs, probes=[tripwire, *probes], what=call, writes=written)
        else:
            with contextlib.ExitStack() as stack:
                for probe in (tripwire, *probes):
                    stack.enter_context(probe)
                result = fn(*args, **kwargs)
            for probe in probes:
                probe.returned(result, args)
    except CheckFailure:
        if (failure := _probes_failure(tripwire, probes, fn)) is not None:
            raise failure from None
        raise
    except NotImplementedError as error:
        raise CheckFailure(
            f"{call}: not implemented yet ({error}). Replace `raise NotImplementedError` with your code."
        ) from None
    except checker_side.BridgeError as error:
        raise CheckFailure(crash_message(call, error)) from None
    except Exception as error:  # any other bug in the answer: say where it broke
        if (failure := _probes_failure(tripwire, probes, fn)) is not None:
            raise failure from None
        message = crash_message(call, error)
        if _is_mixed_dtype_error(error):
            message += f"\n  Likely mistake: {HINTS['mixed_dtype']}"
        # The failure keeps the traceback (it shows the student's frames), not what those frames
        # held: a list that filled the memory until MemoryError is freed for the next cells.
        traceback.clear_frames(error.__traceback__)
        raise CheckFailure(message) from error
    if (failure := _probes_failure(tripwire, probes, fn)) is not None:  # the answer caught the exception, went on
        raise failure
    in_place = {_storage_key(watched[index]): operation for index, operation in tripwire.in_place.items()
                if 0 <= index < len(watched)}
    left = checker_side.left_behind(fn)
    _expect_inputs_unchanged(snapshots, in_place, call, left=left,
                             handed_back=[args[i] for i in _handed_back(args, result, left)] if snapshots else ())
    _expect_objects_unchanged(snapshots, call, fn, left)
    return result


# --------------------------------------------------------------------------------------
# Contract
# --------------------------------------------------------------------------------------


def expect_callable(obj: Any, name: str) -> None:
    if obj is None or not callable(obj):
        raise CheckFailure(f"{name} should be a function or class, got {describe(obj)}.")


def expect_signature(fn: Callable, name: str, parameters: Sequence[str]) -> None:
    """The leading parameters must be named as in the exercise (other tools call them by name)."""
    expect_callable(fn, name)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    actual = [p.name for p in signature.parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if actual[: len(parameters)] != list(parameters):
        raise CheckFailure(
            f"{name} should take the parameters ({', '.join(parameters)}), "
            f"but it takes ({', '.join(actual)}). Keep the signature given in the exercise."
        )


def expect_tensor(
    value: Any,
    *,
    what: str,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    hints: Mapping[tuple[int, ...], str] | None = None,
    dtype_hint: str | None = None,
) -> torch.Tensor:
    """Contract of a returned tensor: type, then exact shape, dtype and device.

    ``hints`` maps wrong shapes that a known mistake produces to the hint for it; ``dtype_hint``
    replaces the keep-the-input's-dtype rule for an exercise whose contract says more (e.g. "compute
    in at least float32 inside, return the input's dtype").
    """
    if not isinstance(value, torch.Tensor):
        raise CheckFailure(f"{what} should be a torch.Tensor, got {describe(value)}.")
    if shape is not None and tuple(value.shape) != tuple(shape):
        message = f"{what} should have shape {shape_str(shape)}, got {shape_str(value.shape)}."
        hint = (hints or {}).get(tuple(value.shape))
        if hint:
            message += f"\n  Likely mistake: {hint}"
        elif value.numel() == math.prod(shape):
            message += " (same number of elements: check the order of axes, not only the count)"
        raise CheckFailure(message)
    if dtype is not None and value.dtype != dtype:
        raise CheckFailure(
            f"{what} should keep the input dtype {dtype}, got {value.dtype}.\n  {dtype_hint or HINTS['keep_dtype']}"
        )
    if device is not None and value.device.type != torch.device(device).type:
        raise CheckFailure(
            f"{what} should be on {torch.device(device).type} like its inputs, got {value.device.type}. "
            "Create new tensors with device=x.device."
        )
    return value


def expect_array(value: Any, *, what: str, shape: Sequence[int] | None = None, dtype: Any = None,
                 hints: Mapping[tuple[int, ...], str] | None = None, dtype_hint: str = "") -> np.ndarray:
    """Contract of a returned NumPy array: an ndarray (not a tensor), exact shape, dtype.

    ``dtype_hint`` is given, on a "Likely mistake:" line of its own, when the dtype is wrong (e.g. how
    float32 became float64).
    """
    if isinstance(value, torch.Tensor):
        raise CheckFailure(f"{what} should return a NumPy ndarray, got a torch tensor ({describe(value)}). "
                           "This notebook is NumPy only: use np.* functions and the @ operator.")
    if not isinstance(value, np.ndarray):
        expected = f" of shape {shape_str(shape)}" if shape is not None else ""
        raise CheckFailure(f"{what} should return a NumPy ndarray{expected}, got {describe(value)}.")
    if shape is not None and tuple(value.shape) != tuple(shape):
        message = f"{what} should have shape {shape_str(shape)}, got {shape_str(value.shape)}."
        hint = (hints or {}).get(tuple(value.shape))
        if hint:
            message += f"\n  Likely mistake: {hint}"
        elif value.size == math.prod(shape):
            message += " (same number of elements: check the order of axes, not only the count)"
        raise CheckFailure(message)
    if dtype is not None and value.dtype != np.dtype(dtype):
        dtype_hint = dtype_hint.strip()  # on a line of its own: a hint may start lower-case
        raise CheckFailure(f"{what} should keep the input dtype {np.dtype(dtype)}, got {value.dtype}."
                           + (f"\n  Likely mistake: {dtype_hint}" if dtype_hint else ""))
    return value


def expect_true(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailure(message)


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number where an exercise asks for one (a count, a measurement, a sequence
    length): Python's int and float and NumPy's scalars (``np.int64(4608)``, ``np.float32``), never a bool, a
    tensor or a string. The one place every check decides it."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def is_integer(value: Any) -> bool:
    """Whether ``value`` is an integer where an exercise asks for an int: Python's int and NumPy's integer
    scalars (``np.int64``), never a bool, a float (even 4608.0) or a tensor."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


# Mixed into every digest of a multiple-choice answer, so that a digest is not the plain hash of a letter.
_CHOICE_SALT = "attention-lab multiple choice v1"


def choice_digest(question: str, letter: str) -> str:
    """What a check module stores instead of a letter of the multiple-choice ``question`` (its right answer, the
    keys of its per-option hints): the first 16 hex digits of a salted SHA-256. The installed package then never
    holds the right letter in clear. Compute a digest with
    ``python -c "from attention_lab.checking import choice_digest; print(choice_digest('ANSWER_X', 'B'))"``."""
    import hashlib

    text = f"{_CHOICE_SALT}|{question}|{letter.strip().upper()}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def expect_choice(answer: Any, *, name: str, options: str, correct_digest: str,
                  hints: Mapping[str, str] | None = None) -> None:
    """A multiple-choice answer: ``None`` (the blank) is "not implemented yet", then one of
    ``options`` (a string like ``"ABC"``, case and spaces forgiven), then the right one.

    ``correct_digest`` is :func:`choice_digest` of ``name`` and the right letter; ``hints`` maps
    the digest of a wrong letter to what to look at again. A wrong answer never names the right letter.
    """
    listed = ", ".join(f'"{option}"' for option in options)
    if answer is None:
        raise CheckFailure(f"{name}: not implemented yet. Set {name} to one of {listed}.")
    expect_true(isinstance(answer, str) and answer.strip().upper() in options and len(answer.strip()) == 1,
                f"{name} should be one of the strings {listed}, got {describe(answer)}.")
    digest = choice_digest(name, answer)
    expect_true(digest == correct_digest, f"{name} = {answer!r} is not right. {(hints or {}).get(digest, '')}".rstrip())


def expect_value_error(fn: Callable, *args: Any, call: str, why: str, must_mention: Sequence[Any] = (),
                       **kwargs: Any) -> None:
    """``fn(*args, **kwargs)`` must raise ValueError whose message names ``must_mention``.

    Bad input gets a clear error: e.g. split_heads with D % H != 0 names D and H. ``why`` says
    what is wrong with the input, for the message when no ValueError comes.
    """
    try:
        fn(*args, **kwargs)
    except ValueError as error:
        text = str(error)
        missing = [str(n) for n in must_mention if str(n) not in text]
        expect_true(not missing, f"{call} raised ValueError, but its message {text!r} should name "
                    f"{' and '.join(str(n) for n in must_mention)} so the caller knows what went wrong.")
        return
    except NotImplementedError:
        raise CheckFailure(f"{call}: not implemented yet. Replace `raise NotImplementedError` with your code.") from None
    except checker_side.BridgeError as error:  # the kernel's failure, not a wrong exception of the answer
        raise CheckFailure(crash_message(call, error)) from None
    except Exception as error:
        raise CheckFailure(f"{call} should raise ValueError ({why}), but raised "
                           f"{type(error).__name__}: {error}") from None
    raise CheckFailure(f"{call} should raise ValueError ({why}), but it returned normally.")


# --------------------------------------------------------------------------------------
# Numbers and diagnosis
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A known wrong answer: what it computes and the hint to give when it matches."""

    output: Any  # tensor / array, or a zero-argument callable producing one (lazy)
    hint: str


def _as_float64_tensor(value: Any) -> torch.Tensor:
    """A float64 CPU copy; complex values become (real, imaginary) pairs on a new last axis."""
    if not isinstance(value, torch.Tensor):
        array = np.asarray(value)
        # np.array copies: a read-only array (e.g. from np.broadcast_to) would make torch warn.
        value = torch.from_numpy(np.array(array, dtype=np.complex128 if np.iscomplexobj(array) else np.float64))
    value = value.detach().cpu()
    if value.is_complex():
        return torch.view_as_real(value.to(torch.complex128)).clone()
    return value.to(dtype=torch.float64)


def _close_mask(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    both_inf = torch.isinf(actual) & torch.isinf(expected) & (torch.sign(actual) == torch.sign(expected))
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    near = (actual - expected).abs() <= atol + rtol * expected.abs()
    return near | both_inf | both_nan


def _all_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> bool:
    return actual.shape == expected.shape and bool(_close_mask(actual, expected, rtol, atol).all())


def _largest_finite_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    difference = (actual - expected).abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    return float(difference.max()) if difference.numel() else 0.0


def diagnose(actual: Any, variants: Sequence[Variant], rtol: float, atol: float, expected: Any = None) -> str | None:
    """The hint of the first known wrong variant that the output matches, if any.

    A variant that coincides with ``expected`` on this input (e.g. "cache ignored" when
    nothing is cached yet) says nothing about the answer, so it is never named.
    """
    got = _as_float64_tensor(actual)
    want = None if expected is None else _as_float64_tensor(expected)
    for variant in variants:
        output = variant.output() if callable(variant.output) else variant.output
        if output is None:
            continue
        candidate = _as_float64_tensor(output)
        if want is not None and _all_close(candidate, want, rtol * 10, atol * 10):
            continue  # indistinguishable from the right answer here
        if _all_close(got, candidate, rtol * 10, atol * 10):
            _record_outside_checks(variant.hint)
            return variant.hint
    return None


def _is_float64(dtype: Any) -> bool:
    return dtype in (torch.float64, torch.complex128, np.dtype("float64"), np.dtype("complex128"))


def _format_pair(got: float, want: float) -> tuple[str, str]:
    """``got`` and ``want`` with just enough significant digits (at least 6) to tell them apart."""
    if math.isfinite(got) and math.isfinite(want) and got != want:
        for digits in range(6, 18):
            got_text, want_text = f"{got:.{digits}g}", f"{want:.{digits}g}"
            if got_text != want_text:
                return got_text, want_text
        return repr(got), repr(want)
    return f"{got:.6g}", f"{want:.6g}"


def describe_difference(got: float, want: float, rtol: float, atol: float) -> str:
    """``got 0.03706972, expected 0.03706965 (difference 7e-08, relative 1.9e-06; tolerance ...)``:
    two numbers that differ, for a message, with enough digits to see how."""
    got_text, want_text = _format_pair(got, want)
    tolerance_text = f"tolerance atol={atol:g}, rtol={rtol:g}"
    if not (math.isfinite(got) and math.isfinite(want)):
        return f"got {got_text}, expected {want_text} ({tolerance_text})"
    difference = abs(got - want)
    relative = f", relative {difference / abs(want):.2g}" if want != 0 else ""
    return f"got {got_text}, expected {want_text} (difference {difference:.2g}{relative}; {tolerance_text})"


def _do_not_match(what: str) -> str:
    """"does not match", or "do not match" after a plural subject ("the losses returned by ...")."""
    words = what.split()
    plural = len(words) >= 2 and words[0].lower() in ("the", "your") and words[1].endswith("s") \
        and not words[1].endswith(("ss", "'s"))
    return "do not match" if plural else "does not match"


def expect_close(
    actual: Any,
    expected: Any,
    *,
    what: str,
    against: str,
    variants: Sequence[Variant] = (),
    rtol: float | None = None,
    atol: float | None = None,
    float64_internals: bool = False,
    float32_tolerance: tuple[float, float] | None = None,
) -> float:
    """Values of ``actual`` must match ``expected`` within the tolerance of actual's dtype/device.

    ``expected`` is computed in float64. On failure the message gives the largest error,
    where it is, both values there with the difference and relative error, the tolerance,
    and -- if the output matches a known wrong variant -- the likely mistake. Returns the
    largest absolute error.

    Precision policy for float64 answers (tensors and NumPy arrays alike): an answer that
    misses float64's tolerance but meets float32's (``float32_tolerance``, by default
    :func:`tolerance` of float32 on actual's device, never tighter than ``rtol``/``atol``)
    computed in float32 inside. With ``float64_internals=False`` that is accepted with a
    one-line note; with ``float64_internals=True`` (the exercise asks to keep float64) it
    fails with a hint naming the downcast.
    """
    if isinstance(actual, torch.Tensor):
        dtype, device = actual.dtype, actual.device
    else:
        dtype, device = np.asarray(actual).dtype, torch.device("cpu")
    default_rtol, default_atol = tolerance(dtype, device)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    got = _as_float64_tensor(actual)
    want = _as_float64_tensor(expected)
    if got.shape != want.shape:
        raise CheckFailure(f"{what} should have shape {shape_str(want.shape)}, got {shape_str(got.shape)}.")
    close = _close_mask(got, want, rtol, atol)
    if bool(close.all()):
        return _largest_finite_difference(got, want)
    diagnose_rtol, diagnose_atol = rtol, atol
    if _is_float64(dtype):
        rtol32, atol32 = float32_tolerance or tolerance(torch.float32, device)
        # A wrong answer computed in float32 inside matches its known mistake only to float32 precision.
        diagnose_rtol, diagnose_atol = max(rtol32, rtol), max(atol32, atol)
        if _all_close(got, want, diagnose_rtol, diagnose_atol):
            largest = _largest_finite_difference(got, want)
            if float64_internals:
                raise CheckFailure(
                    f"{what} matches {against} only to float32 precision, not float64 (largest difference "
                    f"{largest:.2g}; tolerance atol={atol:g}, rtol={rtol:g}).\n  Likely mistake: {HINTS['downcast']}"
                )
            add_note(f"  note: {what} is accurate to float32 precision, not float64 (largest difference "
                      f"{largest:.2g}) on float64 input: your code computes in float32 inside. That is fine here.")
            return largest
    error = torch.where(close, torch.zeros_like(got), (got - want).abs().nan_to_num(math.inf))
    flat_index = int(torch.argmax(error.flatten()))
    index = tuple(int(i) for i in np.unravel_index(flat_index, tuple(got.shape))) if got.dim() else ()
    bad_count = int((~close).sum())
    message = (
        f"{what} {_do_not_match(what)} {against}: {bad_count} of {got.numel()} values are off.\n"
        f"  Largest error at index {index}: {describe_difference(float(got[index]), float(want[index]), rtol, atol)}."
    )
    if torch.isnan(got).any() and not torch.isnan(want).any():
        message += "\n  Your output contains NaN: look for 0/0 (e.g. a softmax row that is entirely masked or overflowed)."
    hint = diagnose(actual, variants, diagnose_rtol, diagnose_atol, expected=want)
    if hint:
        message += f"\n  Likely mistake: {hint}"
    raise CheckFailure(message)


# --------------------------------------------------------------------------------------
# Randomness for property checks
# --------------------------------------------------------------------------------------


def random_generator(seed: int) -> torch.Generator:
    """A private CPU generator: checks never disturb the notebook's own random state."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def randn(*shape: int, generator: torch.Generator, dtype=torch.float64, device="cpu") -> torch.Tensor:
    """Normal samples drawn on the CPU (so every device sees the same numbers), then moved."""
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)


def randint(low: int, high: int, generator: torch.Generator) -> int:
    """One integer in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=generator))


# --------------------------------------------------------------------------------------
# The wrapper every check goes through
# --------------------------------------------------------------------------------------


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The device a check runs the student's code on: the course's device unless given."""
    from attention_lab.device import pick_device

    return pick_device() if device is None else torch.device(device)


@dataclass
class _CheckCall:
    """One running check: its notes are printed after its success line."""

    quiet: bool
    notes: list[str] = field(default_factory=list)


# The checks running now, outermost first (a check may call another one, quietly).
_ACTIVE_CHECKS: list[_CheckCall] = []
# Every check by the name of the student's object it checks (its first parameter), e.g.
# "split_heads" -> [check_split_heads]: how a failing check finds the checks of what it uses.
_REGISTRY: dict[str, list[Callable]] = {}


def add_note(note: str) -> None:
    """Print ``note`` after the running check's success line (once per check), or now outside a check."""
    if not _ACTIVE_CHECKS:
        print(note)
        return
    call = _ACTIVE_CHECKS[0]
    if not call.notes:
        call.notes.append(note)


def registered_checks() -> dict[str, tuple[Callable, ...]]:
    """Every check defined with :func:`check` so far, by the name of the answer it checks."""
    return {name: tuple(checks) for name, checks in _REGISTRY.items()}


def _answer_parameters(function: Callable) -> list[str]:
    """The required positional parameters of a check: the student's objects it takes."""
    return [p.name for p in inspect.signature(function).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]


def _student_namespace(answer: Any) -> Mapping[str, Any] | None:
    """The global namespace the student's answer was defined in (a notebook's is ``__main__``).

    A function carries it as ``__globals__``; a class through its methods (this also works
    for code run with ``exec`` in a namespace of its own), else its module.
    """
    answer = getattr(answer, "func", answer)  # functools.partial
    namespace = getattr(answer, "__globals__", None)
    if isinstance(namespace, dict):
        return namespace
    cls = answer if isinstance(answer, type) else type(answer)
    for member in vars(cls).values():
        namespace = getattr(getattr(member, "__func__", member), "__globals__", None)
        if isinstance(namespace, dict):
            return namespace
    module = sys.modules.get(getattr(cls, "__module__", None) or "")
    return vars(module) if module is not None else None


def _check_of(name: str, near_module: str) -> Callable | None:
    """The single-answer check registered for ``name``, preferring one from ``near_module``."""
    candidates = [c for c in _REGISTRY.get(name, ()) if c.answer_count == 1]
    same_module = [c for c in candidates if c.__module__ == near_module]
    return (same_module or candidates or [None])[0]


_DEPENDENCY_RUN = [False]  # True while the checks of an answer's dependencies run (no recursion)


def _helper_codes(helper: Any) -> frozenset[types.CodeType] | None:
    """The code objects that run when the student's ``helper`` is called: a function's own code, a
    class's methods (its own and those of its student-written bases). None when there is nothing to
    trace (a builtin, a partial of one): such a helper counts as called."""
    helper = getattr(helper, "func", helper)  # functools.partial
    code = getattr(helper, "__code__", None)
    if isinstance(code, types.CodeType):
        return frozenset({code})
    cls = helper if isinstance(helper, type) else type(helper)
    codes = set()
    for klass in cls.__mro__:
        if (klass.__module__ or "").split(".")[0] in ("torch", "builtins", "numpy"):
            continue
        for member in vars(klass).values():
            member = getattr(member, "__func__", member)  # staticmethod, classmethod
            for function in (member, getattr(member, "fget", None)):  # property
                code = getattr(function, "__code__", None)
                if isinstance(code, types.CodeType):
                    codes.add(code)
    return frozenset(codes) or None


class ThreadProfiler:
    """A probe's ``sys.setprofile`` hook, set and taken off again without breaking a profiler the
    notebook already runs. A Python profiler (one set with ``sys.setprofile``) keeps seeing every
    event: it is called after the hook. A C profiler (cProfile, which IPython's ``%prun`` starts, and
    which ``sys.getprofile`` returns as its ``Profile`` object, not a function to call) pauses
    while the hook is set and is enabled again after."""

    def __init__(self, hook: Callable[[types.FrameType, str, Any], None]):
        self.hook = hook
        self._previous: Any = None
        self._set: Any = None  # the function given to sys.setprofile, while it is set

    @property
    def is_set(self) -> bool:
        return self._set is not None and sys.getprofile() is self._set

    def start(self) -> None:
        previous = self._previous = sys.getprofile()
        if callable(previous):
            hook = self.hook

            def hook_then_previous(frame: types.FrameType, event: str, arg: Any) -> None:
                hook(frame, event, arg)
                previous(frame, event, arg)

            self._set = hook_then_previous
        else:
            self._set = self.hook
        sys.setprofile(self._set)

    def stop(self) -> None:
        """Put the previous profiler back (callable from the hook itself)."""
        if self._set is None:
            return
        self._set = None
        if self._previous is None or callable(self._previous):
            sys.setprofile(self._previous)
        else:
            sys.setprofile(None)
            self._previous.enable()


class CallTrace(Probe):
    """Which of the student's helpers (``names``, looked up where the answer was defined) ran while
    a check ran (a :class:`ThreadProfiler`, code-object matching). A failing check names a helper
    that fails its own check only when the answer really called it: a self-contained answer is
    never told to fix a helper it does not use. A helper that cannot be traced (a builtin) counts
    as called."""

    def __init__(self, names: Sequence[str] = (), answer: str | None = None):
        super().__init__(names=list(names), answer=answer)
        self.names, self.answer = list(names), answer
        self.codes: dict[types.CodeType, str] = {}
        self.called: set[str] = set()
        self._profiler = ThreadProfiler(self._profile)  # set until every helper has been seen

    def bind(self, agent: Any) -> None:
        self.watch(agent.namespace)

    def watch(self, namespace: Mapping[str, Any] | None) -> "CallTrace":
        """Trace the helpers of these names in ``namespace`` (the answer's own namespace)."""
        for name in self.names if namespace is not None else ():
            helper = namespace.get(name)
            if helper is None or name == self.answer:
                continue
            helper_codes = _helper_codes(helper)
            if helper_codes is None:
                self.called.add(name)  # untraceable: counts as called
            else:
                self.codes.update(dict.fromkeys(helper_codes, name))
        return self

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = self.codes.get(frame.f_code)
            if name is not None:
                self.called.add(name)
                if self.called.issuperset(self.codes.values()) and self._profiler.is_set:
                    # Every helper has been seen: stop paying for a profiler on each call of the
                    # rest of the check (a whole training run, for a loop).
                    self._profiler.stop()

    def __enter__(self) -> "CallTrace":
        if self.codes and not self.called.issuperset(self.codes.values()):
            self._profiler.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._profiler.stop()

    def findings(self) -> list[str]:
        return sorted(self.called)

    def accept(self, findings: Any) -> None:
        if isinstance(findings, list):
            self.called |= {name for name in findings if isinstance(name, str) and name in self.names}


def _dependency_notes(answer: Any, uses: Sequence[str], near_module: str, device: torch.device,
                      called: Iterable[str] | None = None) -> list[str]:
    """For each helper in ``uses`` that the student defined, that the answer called during the check
    (``called``; None: do not filter) and that fails its own check, one note."""
    namespace = _student_namespace(answer)
    if namespace is None or _DEPENDENCY_RUN[0]:
        return []
    called = None if called is None else set(called)
    notes = []
    _DEPENDENCY_RUN[0] = True
    try:
        for name in uses:
            helper, helper_check = namespace.get(name), _check_of(name, near_module)
            if helper is None or helper is answer or helper_check is None:
                continue  # not defined (the student may not use it) or nothing to check it with
            if called is not None and name not in called:
                continue  # defined, but this answer never called it: not its problem
            try:
                helper_check(helper, device=device, quiet=True)
            except RuleFailure:  # right numbers, a rule broken: it cannot explain this exercise's failure
                continue
            except CheckFailure as failure:
                first_line = str(failure).splitlines()[0] if str(failure) else ""
                notes.append(f"Note: this exercise uses your {name}, which fails its own check "
                             f"({first_line}). Fix {name} first.")
            except Exception:  # a crash inside the helper's check is not this exercise's business
                continue
    finally:
        _DEPENDENCY_RUN[0] = False
    return notes


# A failure lists at most this many different warnings, one line each, counted.
_WARNINGS_SHOWN = 5


@contextlib.contextmanager
def _warnings_held(hold: bool) -> Iterator[Counter]:
    """Hold back the warnings given while a check runs (the student's code's, PyTorch's about it), counted by text:
    printed as they come they go to stderr, where nbgrader counts a test cell that wrote there as failed -- in
    Validate and in grading -- although the check passed; and when it fails they stood above its message. A check
    that passes drops them (its numbers were right); a failure ends with them (:func:`_with_warnings`). Only the
    first few different texts are kept, however many times a training loop warns."""
    held: Counter = Counter()
    if not hold:
        yield held
        return

    def hold_back(message: Any, category: type, *where: Any, **more: Any) -> None:
        text = f"{category.__name__}: {str(message).strip()}"[:300]
        if text in held or len(held) < _WARNINGS_SHOWN:
            held[text] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hold_back
        yield held


def _with_warnings(failure: CheckFailure, held: Counter) -> None:
    """``failure``'s message, followed by the warnings held back while its check ran (one line each, counted)."""
    if held:
        lines = [f"    {text}" + (f" (x{count})" if count > 1 else "") for text, count in held.items()]
        failure.args = ("\n".join([str(failure), "  Warnings while your code ran:", *lines]),)


def check(summary: str, uses: Sequence[str] = ()) -> Callable[[Callable], Callable]:
    """Decorator for a check function ``check_<name>(answer, *, seed=0, device=None, ...)``.

    ``summary`` is the line printed when every layer passes; it may use the check's
    keyword arguments, e.g. ``"split_heads: shapes, values and round trip ({device})"``.

    ``uses`` names the earlier answers this exercise is usually built on, e.g.
    ``uses=("split_heads", "merge_heads")``. While the check runs, calls to the student's own
    objects of those names (looked up where the answer was defined) are traced; when the check
    fails, each of them that the answer called is checked quietly, and each that fails its own
    check is named at the end of the message. A name the student did not define, or did not
    call, is skipped.
    """
    if isinstance(uses, str):
        raise TypeError(f"check(uses=...) takes a sequence of names, e.g. uses=({uses!r},), not a string")

    def decorate(function: Callable) -> Callable:
        answers = _answer_parameters(function)
        if not answers:
            raise TypeError(f"{function.__name__} must take the student's answer as its first parameter")

        @functools.wraps(function)
        def wrapper(answer: Any, *args: Any, quiet: bool = False, **kwargs: Any) -> None:
            call = _CheckCall(quiet=quiet)
            outermost = not _ACTIVE_CHECKS
            _ACTIVE_CHECKS.append(call)
            kwargs["device"] = resolve_device(kwargs.get("device"))
            trace = CallTrace(uses, getattr(answer, "__name__", None)) if uses and not _DEPENDENCY_RUN[0] else None
            bridge = checker_side.bridge_of(answer)
            if trace is not None and bridge is None:
                trace.watch(_student_namespace(answer))
            try:
                with _warnings_held(outermost) as held:
                    try:
                        verify_untampered()
                        with pinned_numerics(), torch.random.fork_rng(devices=[]), contextlib.ExitStack() as stack:
                            if trace is not None and bridge is not None:  # grading: traced in the kernel, call by call
                                bridge.ambient.append(trace)
                                stack.callback(bridge.ambient.remove, trace)
                            elif trace is not None:
                                stack.enter_context(trace)
                            function(answer, *args, **kwargs)
                    except CheckFailure as failure:
                        if uses and not getattr(failure, "dependencies_checked", False) \
                                and "not implemented yet" not in str(failure):
                            failure.dependencies_checked = True
                            notes = _dependency_notes(answer, uses, function.__module__, kwargs["device"],
                                                      called=trace.called if trace is not None else None)
                            if notes:
                                failure.args = ("\n".join([str(failure), *notes]),)
                        _with_warnings(failure, held)
                        if outermost:
                            _record_failure(str(failure))
                        raise
            finally:
                _ACTIVE_CHECKS.pop()
            if not quiet:
                print("✓ " + summary.format(**{**kwargs, "device": kwargs["device"].type}))
                for note in call.notes:
                    print(note)

        wrapper.exercise = answers[0]
        wrapper.answer_count = len(answers)
        wrapper.uses = tuple(uses)
        _REGISTRY.setdefault(answers[0], []).append(wrapper)
        return wrapper

    return decorate


# --------------------------------------------------------------------------------------
# Recording failure messages (for the test suite's hint coverage)
# --------------------------------------------------------------------------------------

# When this environment variable names a folder, every failure message a check shows is
# appended to a file of this process there (one JSON string a line). The test suite sets it
# to find hints no test ever triggers; students never set it.
HINT_LOG_ENV_VAR = "ATTENTION_LAB_HINT_LOG"


def _record_failure(message: str) -> None:
    folder = os.environ.get(HINT_LOG_ENV_VAR)
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"failures-{os.getpid()}.jsonl"), "a", encoding="utf-8") as log:
        log.write(json.dumps(message) + "\n")


def _record_outside_checks(message: str) -> None:
    """Record a message produced outside any check (a test calling expect_* or diagnose directly)."""
    if not _ACTIVE_CHECKS:
        _record_failure(message)
