"""Triton for notebook 06: the import (or a stand-in that explains where Triton is missing) and
the launcher of the FlashAttention kernel the student writes.

* ``triton`` / ``tl``: Triton itself where it is installed (Linux, Colab). On macOS and
  Windows, which have no Triton wheel, a stand-in whose ``@triton.jit`` still defines the
  kernel cell without error; launching it raises :class:`TritonUnavailable`, which says to
  run this part on Colab. Nothing else in the course needs Triton.
* :func:`launch_flash_attention`: the given launcher. One program per (query block,
  batch·head); validates what the GPU compiler would reject even where the interpreter
  accepts it (a ``tl.dot`` reduction dimension < 16), and bf16, which the interpreter gets wrong.

On a machine without a CUDA GPU the course's setup cell sets ``TRITON_INTERPRET=1`` before any
kernel is defined, so ``@triton.jit`` builds an *interpreted* kernel that runs on CPU tensors
(slowly: a few seconds per small check).
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch

from attention_lab.bridge import probes, wire
from attention_lab.bridge.probes import Probe

__all__ = ["triton", "tl", "TRITON_AVAILABLE", "TritonUnavailable", "launch_flash_attention",
           "interpreter_active", "MIN_BLOCK", "poisoned_rows", "LoadWatch", "Overrun", "GuardedOutput",
           "StoreOutOfBounds", "launch_scale", "launch_matmul", "launch_row_softmax", "launch_online_softmax",
           "launch_flash_attention_backward", "launch_split_kv_decode"]

# On an NVIDIA GPU (Triton 3.7's backend), tl.dot needs its reduction dimension K >= 16 (>= 32 for 8-bit inputs);
# M and N may be smaller. Every block size of notebook 06's kernels is the K of some product (block_k and the head
# width in the forward's q kᵀ and P v, block_q in the backward's Pᵀ dO and dSᵀ q), so the launchers ask it of all
# three. The interpreter would accept less.
MIN_BLOCK = 16
LOG2_E = 1.4426950408889634

TRITON_MISSING = (
    "Triton is not installed in this environment. The rest of the course does not need it; this "
    "exercise does. On Linux, install the course with its Triton extra: `pip install -e \".[triton]\"` "
    "in your copy of the course (`make lab` does it for you), or `pip install triton`, then restart the "
    "kernel. Triton publishes wheels for Linux only, so macOS and Windows have none: open this notebook "
    "on Colab (the link at the top: Linux, Triton installed, and a free GPU) to write and check the kernel."
)


class TritonUnavailable(RuntimeError):
    """Raised when a kernel is launched where Triton cannot be imported."""


class _MissingKernel:
    """What ``@triton.jit`` gives without Triton: the kernel cell runs; a launch explains."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")

    def __getitem__(self, grid: Any) -> Callable:
        raise TritonUnavailable(TRITON_MISSING)


class _MissingAttribute:
    """``tl.constexpr``, ``tl.float32`` ... as annotations and defaults: evaluated, never used."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str) -> "_MissingAttribute":
        return _MissingAttribute(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TritonUnavailable(TRITON_MISSING)


class _MissingTriton(_MissingAttribute):
    def jit(self, fn: Callable | None = None, **kwargs: Any) -> Any:
        return _MissingKernel(fn) if fn is not None else _MissingKernel

    @staticmethod
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)


try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # macOS, Windows: no wheel
    triton = _MissingTriton("triton")
    tl = _MissingAttribute("triton.language")
    TRITON_AVAILABLE = False


def interpreter_active() -> bool:
    """True when ``@triton.jit`` builds interpreted kernels (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


MAX_KERNEL_WRAPPERS = 8  # triton.autotune(triton.heuristics(...)(kernel)): a few at most


def _compiled_for_gpu(kernel: Any) -> bool:
    """Whether ``kernel`` was defined while TRITON_INTERPRET was not set, so that it runs on CUDA tensors only:
    a ``JITFunction``, also inside the wrappers that keep the kernel they wrap as ``.fn`` (``triton.autotune``,
    ``triton.heuristics``, a test's kernel with its bug bound); an ``InterpretedFunction`` runs on the CPU.
    Another object launched as ``kernel[grid](...)`` was defined as this process defines kernels now; one
    that cannot be launched so (a function without ``@triton.jit``) fails at its launch, with Python's error."""
    inner = kernel
    for _ in range(MAX_KERNEL_WRAPPERS):
        kind = type(inner).__name__
        if kind in ("JITFunction", "InterpretedFunction"):
            return kind == "JITFunction"
        inner = getattr(inner, "fn", None)
        if inner is None:
            break
    return hasattr(type(kernel), "__getitem__") and not interpreter_active()


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, S, d_head]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q [B, H, S_q, d], k and v [B, H, S_k, d] must agree; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    head_dim = q.shape[-1]
    for name, size in (("block_q", block_q), ("block_k", block_k), ("head_dim", head_dim)):
        if size < MIN_BLOCK or size & (size - 1):
            raise ValueError(f"{name} = {size}: must be a power of two >= {MIN_BLOCK} (tl.arange needs powers "
                             f"of two; on an NVIDIA GPU tl.dot needs its reduction dimension K >= {MIN_BLOCK}, and "
                             "every block size of these kernels is the K of some product -- Triton's interpreter "
                             "would accept smaller blocks, but the kernel would not compile on a GPU)")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the kernel computes in float32 / float16 / bfloat16, got {q.dtype}")
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise ValueError("bfloat16 tl.dot gives wrong results in Triton's interpreter: use float16 or float32 on "
                         "the CPU. bfloat16 is meant for GPUs with bfloat16 tensor cores, of compute capability 8.0 or "
                         "newer (an A100, L4, H100); Colab's T4 (7.5) has none")


def poisoned_rows(x3: torch.Tensor, extra: int) -> torch.Tensor:
    """``x3`` ``[N, S, d]`` as a view into a ``[N, S + extra, d]`` buffer whose ``extra`` rows after
    each head's last row hold NaN: a load without a mask past row ``S - 1`` reads NaN, never
    the next head's rows or memory that is not the tensor's (on a GPU too)."""
    if extra <= 0:
        return x3.contiguous()
    buffer = torch.full((x3.shape[0], x3.shape[1] + extra, x3.shape[2]), float("nan"), dtype=x3.dtype,
                        device=x3.device)
    buffer[:, :x3.shape[1]] = x3
    return buffer[:, :x3.shape[1]]


# What every output's storage holds after its last element (and between its rows, where it has padding).
SENTINEL = 12345.0
# At least this many rows (elements of a 1-D output) of sentinel after every output: an unmasked store of the
# largest block the checks launch lands there, never in memory that is not the output's.
GUARD_ROWS = 64


class StoreOutOfBounds(RuntimeError):
    """A kernel wrote past the end of an output (the sentinel the launcher put after it changed)."""

    def __init__(self, name: str):
        super().__init__(f"the kernel wrote past the end of {name}")
        self.name = name


class GuardedOutput:
    """An output the kernel writes: ``tensor`` (``shape``, ``strides``) inside a buffer of :data:`SENTINEL`
    that also holds ``tail`` elements after it (and whatever the strides skip, e.g. padding rows). The
    data starts as NaN, so an element no program wrote shows; :meth:`verify` raises
    :class:`StoreOutOfBounds` if a store changed the sentinel."""

    def __init__(self, name: str, shape: tuple[int, ...], strides: tuple[int, ...], tail: int,
                 dtype: torch.dtype, device: torch.device):
        span = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides)) if all(shape) else 0
        self.name = name
        self.buffer = torch.full((span + tail,), SENTINEL, dtype=dtype, device=device)
        self.tensor = torch.as_strided(self.buffer, shape, strides)
        self.tensor.fill_(float("nan"))
        covered = torch.zeros(span + tail, dtype=torch.bool, device=device)
        torch.as_strided(covered, shape, strides).fill_(True)
        self._guard = ~covered
        self._sentinel = self.buffer[self._guard].clone()

    def verify(self) -> None:
        if not torch.equal(self.buffer[self._guard], self._sentinel):
            raise StoreOutOfBounds(self.name)


def launch_flash_attention(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                           block_q: int = 32, block_k: int = 32, poison: int = 0,
                           watch: "LoadWatch | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``kernel`` (the student's ``flash_attention_kernel``) on q, k, v: ``(out, lse)``.

    q ``[B, H, S_q, d]``, k and v ``[B, H, S_k, d]``. Each is seen as ``[B·H, S, d]`` (rows of a
    head ``stride_*s`` apart, heads ``stride_*h`` apart); the grid is
    ``(ceil(S_q / block_q), B·H)``: program ``(i, bh)`` computes rows ``i·block_q …`` of head
    ``bh``. ``out`` has q's dtype; ``lse`` is float32 ``[B, H, S_q]`` (natural log).
    ``poison``: the checks put that many rows of NaN after each head's rows of q, k and v, so
    that a ``tl.load`` without a mask shows as NaN instead of reading whatever memory follows.
    ``out`` and ``lse`` are written into :class:`GuardedOutput` buffers: a store past their end lands on a
    sentinel, and raises :class:`StoreOutOfBounds` after the launch. ``watch``, a :class:`LoadWatch`
    (one is made if not given), sees every load and store (in the interpreter only).
    """
    if isinstance(kernel, _MissingKernel):
        raise TritonUnavailable(TRITON_MISSING)
    _validate(q, k, v, block_q, block_k)
    if q.device.type == "cpu" and _compiled_for_gpu(kernel):
        raise RuntimeError("this kernel was compiled for a GPU, but the tensors are on the CPU. On a machine "
                           "without a GPU, TRITON_INTERPRET=1 must be set *before* the kernel is defined: run "
                           "the setup cell at the top of the notebook, then the kernel's cell again.")
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    q3 = poisoned_rows(q.reshape(batch * heads, seq_q, head_dim), poison)  # [B·H, S_q, d]
    k3 = poisoned_rows(k.reshape(batch * heads, seq_k, head_dim), poison)  # [B·H, S_k, d]
    v3 = poisoned_rows(v.reshape(batch * heads, seq_k, head_dim), poison)  # [B·H, S_k, d]
    guard_rows = max(poison, block_q, GUARD_ROWS)
    out = GuardedOutput("out", tuple(q3.shape), q3.stride(), guard_rows * q3.stride(1), q.dtype, q.device)
    lse = GuardedOutput("lse", (batch * heads, seq_q), (seq_q, 1), guard_rows, torch.float32, q.device)
    watch = LoadWatch() if watch is None else watch
    for name, tensor, rows in (("Q", q3, seq_q), ("K", k3, seq_k), ("V", v3, seq_k), ("out", out.tensor, seq_q),
                               ("lse", lse.tensor, seq_q)):
        watch.add(name, tensor, rows)
    with watch:
        _run(kernel, (triton.cdiv(seq_q, block_q), batch * heads), q3, k3, v3, out.tensor, lse.tensor,
             q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
             seq_q, seq_k, head_dim ** -0.5, CAUSAL=bool(causal), BLOCK_Q=block_q, BLOCK_K=block_k,
             HEAD_DIM=head_dim)
    out.verify()
    lse.verify()
    out, lse = out.tensor, lse.tensor
    return out.reshape(batch, heads, seq_q, head_dim), lse.view(batch, heads, seq_q)


def launch_flash_attention_backward(kernel_dkdv: Any, kernel_dq: Any, q: torch.Tensor, k: torch.Tensor,
                                    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                                    causal: bool = False, block_q: int = 32, block_k: int = 32, poison: int = 0,
                                    watch: "LoadWatch | None" = None) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv)`` from the two backward kernels (the challenge of notebook 06).

    ``D = rowsum(dout ∘ out)`` is computed here (float32, ``[B·H, S_q]``, like ``lse``). Then
    ``kernel_dkdv`` runs one program per (key block, batch·head): grid ``(ceil(S_k / block_k), B·H)``,
    arguments ``(Q, K, V, DO, Lse, Delta, DK, DV, stride_qh, stride_qs, stride_kh, stride_ks,
    stride_vh, stride_vs, seq_q, seq_k, sm_scale, CAUSAL, BLOCK_Q, BLOCK_K, HEAD_DIM)``; and
    ``kernel_dq`` one program per (query block, batch·head): grid ``(ceil(S_q / block_q), B·H)``,
    arguments ``(Q, K, V, DO, Lse, Delta, DQ, <the same strides>, seq_q, seq_k, sm_scale, CAUSAL,
    BLOCK_Q, BLOCK_K, HEAD_DIM)``. DO and DQ have q's layout, DK and DV k's and v's. The gradients
    have the inputs' dtypes (the kernels accumulate in float32). They are written into
    :class:`GuardedOutput` buffers; ``poison`` and ``watch`` as in :func:`launch_flash_attention`.
    """
    for kernel in (kernel_dkdv, kernel_dq):
        if isinstance(kernel, _MissingKernel):
            raise TritonUnavailable(TRITON_MISSING)
    _validate(q, k, v, block_q, block_k)
    if q.device.type == "cpu" and (_compiled_for_gpu(kernel_dkdv) or _compiled_for_gpu(kernel_dq)):
        raise RuntimeError("these kernels were compiled for a GPU, but the tensors are on the CPU: run the setup "
                           "cell at the top of the notebook (it sets TRITON_INTERPRET=1), then the kernels' cell.")
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    bh = batch * heads
    q3 = poisoned_rows(q.reshape(bh, seq_q, head_dim), poison)  # dout shares q's layout
    do3 = poisoned_rows(dout.to(q.dtype).reshape(bh, seq_q, head_dim), poison)
    k3 = poisoned_rows(k.reshape(bh, seq_k, head_dim), poison)  # v shares k's layout
    v3 = poisoned_rows(v.reshape(bh, seq_k, head_dim), poison)
    lse3 = lse.reshape(bh, seq_q).to(torch.float32).contiguous()
    delta = (dout.float() * out.float()).sum(-1).reshape(bh, seq_q).contiguous()
    guard_rows = max(poison, block_q, block_k, GUARD_ROWS)
    dq = GuardedOutput("dq", tuple(q3.shape), q3.stride(), guard_rows * q3.stride(1), q.dtype, q.device)
    dk = GuardedOutput("dk", tuple(k3.shape), k3.stride(), guard_rows * k3.stride(1), k.dtype, k.device)
    dv = GuardedOutput("dv", tuple(v3.shape), v3.stride(), guard_rows * v3.stride(1), v.dtype, v.device)
    watch = LoadWatch() if watch is None else watch
    for name, tensor, rows in (("Q", q3, seq_q), ("K", k3, seq_k), ("V", v3, seq_k), ("dout", do3, seq_q),
                               ("lse", lse3, seq_q), ("D", delta, seq_q), ("dq", dq.tensor, seq_q),
                               ("dk", dk.tensor, seq_k), ("dv", dv.tensor, seq_k)):
        watch.add(name, tensor, rows)
    strides = (q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1))
    constants = {"CAUSAL": bool(causal), "BLOCK_Q": block_q, "BLOCK_K": block_k, "HEAD_DIM": head_dim}
    with watch:
        _run(kernel_dkdv, (triton.cdiv(seq_k, block_k), bh), q3, k3, v3, do3, lse3, delta, dk.tensor, dv.tensor,
             *strides, seq_q, seq_k, head_dim ** -0.5, **constants)
        _run(kernel_dq, (triton.cdiv(seq_q, block_q), bh), q3, k3, v3, do3, lse3, delta, dq.tensor, *strides,
             seq_q, seq_k, head_dim ** -0.5, **constants)
    for guarded in (dq, dk, dv):
        guarded.verify()
    dq, dk, dv = dq.tensor, dk.tensor, dv.tensor
    shape_q, shape_k = (batch, heads, seq_q, head_dim), (batch, heads, seq_k, head_dim)
    return dq.reshape(shape_q), dk.reshape(shape_k), dv.reshape(shape_k)


# --------------------------------------------------------------------------------------
# The warm-up kernels' launchers: a masked load and store, a tiled matmul, a row softmax
# --------------------------------------------------------------------------------------


def _check_kernel(kernel: Any, *tensors: torch.Tensor) -> None:
    if isinstance(kernel, _MissingKernel):
        raise TritonUnavailable(TRITON_MISSING)
    if tensors[0].device.type == "cpu" and _compiled_for_gpu(kernel):
        raise RuntimeError("this kernel was compiled for a GPU, but the tensors are on the CPU: run the setup cell "
                           "at the top of the notebook (it sets TRITON_INTERPRET=1), then the kernel's cell again.")


def _padded(x: torch.Tensor, rows: int, cols: int, fill: float) -> torch.Tensor:
    """``x`` [R, C] as a view into a [R + rows, C + cols] buffer filled with ``fill`` around it."""
    buffer = torch.full((x.shape[0] + rows, x.shape[1] + cols), fill, dtype=x.dtype, device=x.device)
    buffer[:x.shape[0], :x.shape[1]] = x
    return buffer[:x.shape[0], :x.shape[1]]


def _run(kernel: Any, grid: tuple[int, ...], *args: Any, **constants: Any) -> None:
    try:
        kernel[grid](*args, **constants)
    except Exception as error:
        text = f"{type(error).__name__}: {error}"
        if "NotImplementedError" in text:
            stub = re.search(r"NotImplementedError\(['\"](.*?)['\"]\)", text)
            raise NotImplementedError(stub.group(1) if stub else "the kernel is not written yet") from None
        raise


def launch_scale(kernel: Any, x: torch.Tensor, alpha: float, block: int = 64, poison: int = 0,
                 watch: "LoadWatch | None" = None) -> torch.Tensor:
    """``alpha * x`` for a 1-D ``x`` by ``kernel(X, Out, n, alpha, BLOCK)``, one program per ``block``
    elements: a grid of ``ceil(n / block)`` programs. ``poison``: NaN after ``x``. ``out`` is a
    :class:`GuardedOutput` (a store past its end raises :class:`StoreOutOfBounds`); ``watch`` sees every
    load and store (in the interpreter)."""
    _check_kernel(kernel, x)
    n = x.shape[0]
    x_view = _padded(x.reshape(n, 1).T, 0, poison, float("nan"))[0]  # [n] in a [n + poison] buffer
    out = GuardedOutput("out", (n,), (1,), max(poison, block, GUARD_ROWS), x.dtype, x.device)
    watch = LoadWatch() if watch is None else watch
    watch.add("x", x_view)
    watch.add("out", out.tensor)
    with watch:
        _run(kernel, (triton.cdiv(n, block),), x_view, out.tensor, n, alpha, BLOCK=block)
    out.verify()
    return out.tensor.clone()


def launch_matmul(kernel: Any, a: torch.Tensor, b: torch.Tensor, block_m: int = 16, block_n: int = 16,
                  block_k: int = 16, poison: int = 0, watch: "LoadWatch | None" = None) -> torch.Tensor:
    """``a @ b`` (``[M, K] @ [K, N]``) by ``kernel(A, B, C, M, N, K, stride_am, stride_ak, stride_bk,
    stride_bn, stride_cm, stride_cn, BLOCK_M, BLOCK_N, BLOCK_K)``: program ``(i, j)`` computes the
    ``[BLOCK_M, BLOCK_N]`` block of C at rows ``i·BLOCK_M``, columns ``j·BLOCK_N``; C is float32,
    a :class:`GuardedOutput` with sentinel columns after each row and rows after the last."""
    _check_kernel(kernel, a, b)
    m, k = a.shape
    n = b.shape[1]
    a_view = _padded(a, poison, poison, float("nan"))
    b_view = _padded(b, poison, poison, float("nan"))
    guard = max(poison, block_m, block_n, GUARD_ROWS)
    c = GuardedOutput("C", (m, n), (n + guard, 1), guard * (n + guard), torch.float32, a.device)
    watch = LoadWatch() if watch is None else watch
    for name, tensor in (("A", a_view), ("B", b_view), ("C", c.tensor)):
        watch.add(name, tensor)
    with watch:
        _run(kernel, (triton.cdiv(m, block_m), triton.cdiv(n, block_n)), a_view, b_view, c.tensor, m, n, k,
             a_view.stride(0), a_view.stride(1), b_view.stride(0), b_view.stride(1), c.tensor.stride(0),
             c.tensor.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    c.verify()
    return c.tensor.clone()


def launch_row_softmax(kernel: Any, x: torch.Tensor, poison: int = 0,
                       watch: "LoadWatch | None" = None) -> torch.Tensor:
    """``softmax(x, dim=-1)`` of a 2-D ``x`` by ``kernel(X, Out, n_cols, stride_x, stride_out, BLOCK)``:
    one program per row, ``BLOCK`` the next power of two >= n_cols. ``out`` is a :class:`GuardedOutput`
    with sentinel columns after each row and rows after the last."""
    _check_kernel(kernel, x)
    return _launch_per_row(kernel, x, triton.next_power_of_2(x.shape[1]), poison, watch)


def launch_online_softmax(kernel: Any, x: torch.Tensor, block: int = 64, poison: int = 0,
                          watch: "LoadWatch | None" = None) -> torch.Tensor:
    """``softmax(x, dim=-1)`` of a 2-D ``x`` (float32 or float16) by ``kernel(X, Out, n_cols, stride_x,
    stride_out, BLOCK)``: one program per row, and ``BLOCK`` (a power of two) may be shorter than the row,
    so the kernel loops over the row's column blocks. Out has x's dtype. ``poison``: NaN after each row of
    x; ``out`` is a :class:`GuardedOutput` (sentinels after each row and after the last), so the checks
    see loads and stores past the end, and a stray store cannot reach the notebook's memory."""
    _check_kernel(kernel, x)
    if block < 1 or block & (block - 1):
        raise ValueError(f"block = {block}: must be a power of two (tl.arange needs one)")
    return _launch_per_row(kernel, x, block, poison, watch)


def _launch_per_row(kernel: Any, x: torch.Tensor, block: int, poison: int, watch: "LoadWatch | None") -> torch.Tensor:
    """One program per row of ``x`` running ``kernel(X, Out, n_cols, stride_x, stride_out, BLOCK)``: NaN
    after each row of x, out a :class:`GuardedOutput`, every load and store watched."""
    rows, cols = x.shape
    x_view = _padded(x, poison, poison, float("nan"))
    guard = max(poison, block, GUARD_ROWS)
    out = GuardedOutput("out", (rows, cols), (cols + guard, 1), guard * (cols + guard), x.dtype, x.device)
    watch = LoadWatch() if watch is None else watch
    watch.add("x", x_view)
    watch.add("out", out.tensor)
    with watch:
        _run(kernel, (rows,), x_view, out.tensor, cols, x_view.stride(0), out.tensor.stride(0), BLOCK=block)
    out.verify()
    return out.tensor.clone()


# --------------------------------------------------------------------------------------
# Notebook 07's launcher: split-K decoding (Flash-Decoding), one query per sequence
# --------------------------------------------------------------------------------------


def poisoned_columns(x3: torch.Tensor, extra_rows: int, extra_columns: int) -> torch.Tensor:
    """``x3`` ``[N, S, d]`` as a view into a ``[N, S + extra_rows, d + extra_columns]`` buffer of NaN: a load
    past a head's last row, or past a row's ``d`` features (a head size that is no power of two loaded
    without its mask), reads NaN."""
    if extra_rows <= 0 and extra_columns <= 0:
        return x3.contiguous()
    buffer = torch.full((x3.shape[0], x3.shape[1] + max(extra_rows, 0), x3.shape[2] + max(extra_columns, 0)),
                        float("nan"), dtype=x3.dtype, device=x3.device)
    buffer[:, :x3.shape[1], :x3.shape[2]] = x3
    return buffer[:, :x3.shape[1], :x3.shape[2]]


def launch_split_kv_decode(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_splits: int,
                           block: int = 16, merge: Callable | None = None, poison: int = 0,
                           watch: "LoadWatch | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-Decoding with ``kernel`` (the student's ``split_kv_decode_kernel``): one new query per sequence.

    q ``[B, H_q, d]``; k and v ``[B, H_kv, L, d]``, ``H_q`` a multiple of ``H_kv``. The keys are cut into
    ``num_splits`` contiguous splits of ``split_len = ceil(L / num_splits)`` (the last shorter; the trailing
    ones empty when ``num_splits > L``). The grid is ``(B·H_q, num_splits)``: program ``(b·H_q + h, s)``
    attends query head ``h`` of sequence ``b`` to the keys ``s·split_len … min((s + 1)·split_len, L) − 1`` of
    its KV head, ``BLOCK = block`` keys at a time, and writes that split's state: ``out`` (``d`` float32
    numbers) and ``lse`` (natural log; ``-inf`` and ``out = 0`` for an empty split). The kernel's arguments::

        (Q, K, V, OutParts, LseParts,
         stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
         stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
         num_heads, num_kv_heads, seq_len, split_len, head_dim, sm_scale, BLOCK, BLOCK_D)

    (element ``i`` of a head's row at ``+ i``: the last axis is contiguous; ``BLOCK_D`` the next power of two
    >= ``head_dim``, ``sm_scale = 1/sqrt(d)``). The parts are ``[B, H_q, num_splits, d]`` and
    ``[B, H_q, num_splits]``, float32. ``merge`` (the notebook passes its ``merge_attention_states``) gets them
    with the splits on the leading axis, ``(outs [n, B, H_q, d], lses [n, B, H_q])``, and its ``(out, lse)``
    is returned, ``out`` in q's dtype; without ``merge`` the parts themselves are returned. ``poison`` rows
    (and, where ``d`` is no power of two, columns) of NaN follow k, v and q; the parts are
    :class:`GuardedOutput` buffers; ``watch`` sees every load and store (in the interpreter).
    """
    _check_kernel(kernel, q)
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"q must be [B, H_q, d] and k, v [B, H_kv, L, d]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    batch, heads, head_dim = q.shape
    kv_heads, seq_len = k.shape[1], k.shape[2]
    if k.shape[0] != batch or k.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(f"q [B, H_q, d] = {tuple(q.shape)} and k [B, H_kv, L, d] = {tuple(k.shape)} must share B "
                         f"and d, and H_q = {heads} must be a multiple of H_kv = {kv_heads}")
    if num_splits < 1 or seq_len < 1:
        raise ValueError(f"num_splits = {num_splits} and L = {seq_len} must be at least 1")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block = {block}: must be a power of two (tl.arange needs one)")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the kernel computes in float32 / float16 / bfloat16, got {q.dtype}")
    block_d = triton.next_power_of_2(head_dim)
    pad = block_d - head_dim + (poison if block_d != head_dim else 0)
    q3 = poisoned_columns(q.reshape(batch * heads, 1, head_dim), poison, pad if poison else 0)
    k3 = poisoned_columns(k.reshape(batch * kv_heads, seq_len, head_dim), poison, pad if poison else 0)
    v3 = poisoned_columns(v.reshape(batch * kv_heads, seq_len, head_dim), poison, pad if poison else 0)
    split_len = -(-seq_len // num_splits)
    guard = max(poison, num_splits, GUARD_ROWS)
    parts = (batch * heads, num_splits, head_dim)
    out = GuardedOutput("out", parts, (num_splits * (head_dim + guard), head_dim + guard, 1),
                        guard * (head_dim + guard), torch.float32, q.device)
    lse = GuardedOutput("lse", parts[:2], (num_splits, 1), guard, torch.float32, q.device)
    watch = LoadWatch() if watch is None else watch
    for name, tensor, rows in (("Q", q3, 1), ("K", k3, seq_len), ("V", v3, seq_len), ("out", out.tensor, num_splits),
                               ("lse", lse.tensor, num_splits)):
        watch.add(name, tensor, rows)
    with watch:
        _run(kernel, (batch * heads, num_splits), q3, k3, v3, out.tensor, lse.tensor,
             heads * q3.stride(0), q3.stride(0), kv_heads * k3.stride(0), k3.stride(0), k3.stride(1),
             kv_heads * v3.stride(0), v3.stride(0), v3.stride(1),
             heads * out.tensor.stride(0), out.tensor.stride(0), out.tensor.stride(1), heads * lse.tensor.stride(0),
             lse.tensor.stride(0), heads, kv_heads, seq_len, split_len, head_dim, head_dim ** -0.5,
             BLOCK=block, BLOCK_D=block_d)
    out.verify()
    lse.verify()
    out_parts = out.tensor.reshape(batch, heads, num_splits, head_dim)
    lse_parts = lse.tensor.reshape(batch, heads, num_splits)
    if merge is None:
        return out_parts, lse_parts
    merged_out, merged_lse = merge(out_parts.movedim(2, 0), lse_parts.movedim(2, 0))
    return merged_out.to(q.dtype), merged_lse


# --------------------------------------------------------------------------------------
# What a kernel reads and writes, seen from Triton's interpreter (the checks' second pair of eyes)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Overrun:
    """A ``tl.load`` or ``tl.store`` whose enabled lanes reached past the end of a tensor.

    ``cause``: ``"no_mask"`` (the operation has no mask), ``"last_lane"`` (a mask, but it lets
    through exactly the first element past the end on an axis: ``offs <= n``), ``"past_end"`` (a
    mask, and lanes further past the end: a condition missing for an axis, or an address computed
    wrongly) or ``"stray"`` (an address outside every tensor of the launch: computed wrongly; the
    watch disabled those lanes, so that the notebook's kernel survives).
    """

    operation: str  # "load" or "store"
    program: tuple[int, ...]
    line: str
    cause: str


class LoadWatch:
    """Under Triton's interpreter, records every ``tl.load`` and ``tl.store`` a kernel makes into named tensors.

    Each watched tensor is seen as ``heads × rows`` (``[N, S, d]``: N heads of S rows; ``[R, C]``: R
    "heads" of C elements; 1-D: one head), inside its storage (the padding or sentinel after it is
    its storage too). For each operation that touches it:

    * ``beyond[name]``: the first load or store whose enabled lanes reach a row ``>= rows`` or a head
      ``>= heads``, as an :class:`Overrun` (what, which program, the student's line, why);
    * ``blocks[name]``: the set of ``(program, first row read)`` of loads with an enabled lane inside
      the data -- for K, the key blocks each program visited;
    * ``touched[name][program]``: ``[first head, last head, first row, last row]`` the program reached
      in the tensor (past its end included): which rows and columns a program works on.

    Lanes whose address lies outside every watched tensor are disabled before the operation runs
    (the first such operation is kept in ``stray``, an ``Overrun`` with cause ``"stray"``): in the
    interpreter such a store would corrupt the notebook's own memory and kill its kernel. Every tensor a launch passes must therefore be
    watched. Only the interpreter can be watched (it runs each operation in Python); natively
    :attr:`active` is False and nothing is recorded. Used as a context manager.
    """

    def __init__(self, regions: dict[str, tuple[torch.Tensor, int]] | None = None):
        self.regions: dict[str, tuple[int, ...]] = {}
        self.beyond: dict[str, Overrun] = {}
        self.blocks: dict[str, set] = {}
        self.touched: dict[str, dict[tuple[int, ...], list[int]]] = {}
        self.stray: Overrun | None = None
        self.active = False
        self._builder: Any = None
        self._unmasked = False
        for name, (tensor, rows) in (regions or {}).items():
            self.add(name, tensor, rows)

    def add(self, name: str, tensor: torch.Tensor, rows: int | None = None) -> None:
        """Watch ``tensor`` (1-D, ``[R, C]`` or ``[N, S, d]``-strided) and the rest of its storage after it.

        ``rows``: how many rows of each head are data (default: all of ``tensor``'s rows).
        """
        size = tensor.element_size()
        storage = tensor.untyped_storage()
        end = storage.data_ptr() + storage.nbytes()
        if tensor.dim() == 1:
            heads, head_stride, row_stride, rows = 1, end - tensor.data_ptr(), tensor.stride(0) * size, \
                tensor.shape[0] if rows is None else rows
        else:
            heads, head_stride, row_stride = tensor.shape[0], tensor.stride(0) * size, tensor.stride(1) * size
            rows = tensor.shape[1] if rows is None else rows
        self.add_region(name, tensor.data_ptr(), end, head_stride, row_stride, rows, heads)

    def add_region(self, name: str, start: int, end: int, head_stride: int, row_stride: int, rows: int,
                   heads: int) -> None:
        """Watch the bytes ``[start, end)``: heads ``head_stride`` bytes apart, rows ``row_stride`` apart in
        each; rows ``>= rows`` and heads ``>= heads`` are past the end."""
        self.regions[name] = (start, end, max(head_stride, 1), max(row_stride, 1), rows, heads)
        self.blocks[name] = set()
        self.touched[name] = {}

    def __enter__(self) -> "LoadWatch":
        if not (self.regions and TRITON_AVAILABLE and interpreter_active()):
            return self
        try:
            from triton.runtime import interpreter
        except ImportError:  # an interpreter of another shape: watch nothing
            return self
        builder = getattr(interpreter, "interpreter_builder", None)
        names = ("create_masked_load", "create_masked_store", "create_load", "create_store")
        if builder is None or not all(hasattr(builder, name) for name in names):
            return self
        masked_load, masked_store = builder.create_masked_load, builder.create_masked_store
        plain_load, plain_store = builder.create_load, builder.create_store
        handle = getattr(interpreter, "TensorHandle")

        def create_masked_load(ptrs, mask, other, *args: Any, **kwargs: Any) -> Any:
            mask = self._record("load", builder, handle, ptrs.data, mask)
            return masked_load(ptrs, mask, other, *args, **kwargs)

        def create_masked_store(ptrs, value, mask, *args: Any, **kwargs: Any) -> Any:
            mask = self._record("store", builder, handle, ptrs.data, mask)
            return masked_store(ptrs, value, mask, *args, **kwargs)

        def unmasked(operation: Callable) -> Callable:
            def run(*args: Any, **kwargs: Any) -> Any:  # the interpreter adds an all-true mask, then calls the above
                self._unmasked = True
                try:
                    return operation(*args, **kwargs)
                finally:
                    self._unmasked = False
            return run

        builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
        builder.create_load, builder.create_store = unmasked(plain_load), unmasked(plain_store)
        self._builder, self.active = builder, True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._builder is not None:
            for name in ("create_masked_load", "create_masked_store", "create_load", "create_store"):
                delattr(self._builder, name)  # the class's methods again
            self._builder = None

    def findings(self) -> dict:
        """What this watch saw, as data (a launch in the student's kernel sends it to the checker)."""
        def overrun(found: Overrun | None) -> list | None:
            return None if found is None else [found.operation, list(found.program), found.line[:400], found.cause]

        return {"active": self.active, "stray": overrun(self.stray),
                "beyond": [[name, overrun(found)] for name, found in self.beyond.items()],
                "blocks": [[name, [[list(program), row] for program, row in sorted(found)]]
                           for name, found in self.blocks.items()],
                "touched": [[name, [[list(program), box] for program, box in found.items()]]
                            for name, found in self.touched.items()]}

    def accept(self, findings: Any) -> None:
        """Take in what the kernel's watch saw (data from the student's process: checked to be well-formed;
        what it says is that process's word)."""
        def program(value: Any) -> tuple[int, ...]:
            if not (isinstance(value, list) and len(value) <= 3 and all(type(i) is int and 0 <= i < 2**31 for i in value)):
                raise wire.WireError("a malformed program id")
            return tuple(value)

        def overrun(value: Any) -> Overrun | None:
            if value is None:
                return None
            if not (isinstance(value, list) and len(value) == 4 and value[0] in ("load", "store")
                    and value[3] in ("no_mask", "last_lane", "past_end", "stray") and probes.strings([value[2]])):
                raise wire.WireError("a malformed overrun")
            return Overrun(value[0], program(value[1]), value[2], value[3])

        def named(value: Any) -> list:
            if not (isinstance(value, list) and len(value) <= 16 and all(
                    isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and item[0].isidentifier()
                    and len(item[0]) <= 20 for item in value)):
                raise wire.WireError("a malformed load watch")
            return value

        if not isinstance(findings, dict) or not isinstance(findings.get("active"), bool):
            raise wire.WireError("a malformed load watch")
        self.active = findings["active"]
        self.stray = overrun(findings.get("stray"))
        for name, found in named(findings.get("beyond")):
            self.beyond[name] = overrun(found)
        for name, found in named(findings.get("blocks")):
            if not (isinstance(found, list) and len(found) <= probes.MAX_FINDINGS and all(
                    isinstance(item, list) and len(item) == 2 and type(item[1]) is int for item in found)):
                raise wire.WireError("malformed blocks of a load watch")
            self.blocks[name] = {(program(item[0]), item[1]) for item in found}
        for name, found in named(findings.get("touched")):
            if not (isinstance(found, list) and len(found) <= probes.MAX_FINDINGS and all(
                    isinstance(item, list) and len(item) == 2 and isinstance(item[1], list) and len(item[1]) == 4
                    and all(type(i) is int for i in item[1]) for item in found)):
                raise wire.WireError("malformed parts of a load watch")
            self.touched[name] = {program(item[0]): list(item[1]) for item in found}

    def _record(self, operation: str, builder: Any, handle: Any, pointers: Any, mask: Any) -> Any:
        """Record one operation; return its mask, with the lanes outside every watched tensor disabled."""
        import numpy as np

        shape = np.asarray(pointers).shape
        addresses = np.asarray(pointers).astype(np.int64).reshape(shape)
        enabled = np.broadcast_to(np.asarray(mask.data, dtype=bool), shape)
        program = tuple(int(i) for i in (builder.grid_idx or ()))
        has_mask = not self._unmasked
        known = np.zeros(shape, dtype=bool)
        for name, (start, end, head_stride, row_stride, rows, heads) in self.regions.items():
            inside = enabled & (addresses >= start) & (addresses < end)
            known |= (addresses >= start) & (addresses < end)
            if not inside.any():
                continue
            offsets = addresses[inside] - start
            head, row = offsets // head_stride, (offsets % head_stride) // row_stride
            past = (row >= rows) | (head >= heads)
            if past.any() and name not in self.beyond:
                last_lane = bool(((row[past] <= rows) & (head[past] <= heads)).all())
                cause = "no_mask" if not has_mask else "last_lane" if last_lane else "past_end"
                self.beyond[name] = Overrun(operation, program, _kernel_line(), cause)
            if operation == "load" and not past.all():
                self.blocks[name].add((program, int(row[~past].min())))
            box = self.touched[name].setdefault(program, [int(head.min()), int(head.max()), int(row.min()),
                                                          int(row.max())])
            box[:] = [min(box[0], int(head.min())), max(box[1], int(head.max())), min(box[2], int(row.min())),
                      max(box[3], int(row.max()))]
        stray = enabled & ~known
        if not stray.any():
            return mask
        if self.stray is None:
            self.stray = Overrun(operation, program, _kernel_line(), "stray")
        return handle(np.asarray(enabled & known), mask.dtype)


def _kernel_line() -> str:
    """The innermost line of the running kernel (not Triton's, not the course's), as written."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        name = frame.filename.replace("\\", "/")
        if any(part in name for part in ("/triton/", "/attention_lab/", "/numpy/", "<frozen")):
            continue
        return (frame.line or "").strip()
    return ""


# --------------------------------------------------------------------------------------
# A launch in the student's kernel, seen from the trusted checker
# --------------------------------------------------------------------------------------

# The launchers a check may have the student's kernel run (by name: nothing else is ever run there).
LAUNCHERS = ("launch_scale", "launch_matmul", "launch_row_softmax", "launch_online_softmax", "launch_flash_attention",
             "launch_flash_attention_backward", "launch_split_kv_decode")
_LAUNCH_ERRORS = {"StoreOutOfBounds": StoreOutOfBounds, "TritonUnavailable": TritonUnavailable,
                  "NotImplementedError": NotImplementedError}
MAX_WARNING_TEXTS, MAX_WARNINGS = 50, 10_000


# NumPy's warnings that Triton's interpreter gives for values a correct kernel computes and then discards: -inf -
# (-inf) in a row that has seen no key yet, 0 / 0 and log2(0) in the given epilogue of a query that sees no key,
# masked lanes. They say nothing about the student's kernel (its wrong numbers do, and the checks name them): a
# launch by the checks never shows them. Other warnings (an overflow: a missing max) are kept.
_DISCARDED_VALUE_WARNINGS = r"(invalid value|divide by zero) encountered"


@contextlib.contextmanager
def _discarded_value_warnings_ignored():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DISCARDED_VALUE_WARNINGS, category=RuntimeWarning)
        yield


def launch(launcher: Callable, kernel: Any, *args: Any, watch: LoadWatch, **kwargs: Any) -> Any:
    """``launcher(kernel, *args, watch=watch, **kwargs)`` where the kernel is: here in the lab; in
    grading (``kernel`` a proxy of the student's) in the student's process, by :class:`KernelLaunch`,
    whose report (the result, what ``watch`` saw, the warnings, the exception) is replayed here."""
    from attention_lab.bridge import checker_side

    if not checker_side.is_remote(kernel):
        with _discarded_value_warnings_ignored():
            return launcher(kernel, *args, watch=watch, **kwargs)
    probe = KernelLaunch(launcher=launcher.__name__, args=list(args), kwargs=kwargs)
    checker_side.measure(kernel, probe, f"the launch of your kernel by {launcher.__name__}")
    result = probe.replay(watch)
    # The tensors arrive on the CPU. Back on the device the kernel ran on where this process has it: a check
    # judges a kernel by where it ran (fp32 tl.dot runs in TF32 on a GPU), as in the lab; else the inputs'.
    device = next((arg.device for arg in args if isinstance(arg, torch.Tensor)), torch.device("cpu"))
    if probe.result["ran_on"] == "cuda" and torch.cuda.is_available():
        device = torch.device("cuda")
    return result.to(device) if isinstance(result, torch.Tensor) else tuple(tensor.to(device) for tensor in result)


class KernelLaunch(Probe):
    """One of the course's launchers (:data:`LAUNCHERS`, by name) run on the student's kernel in its own
    process (``measure``), with a :class:`LoadWatch`; its findings are data: the launch's result (tensors),
    the watch's records, the warnings Triton's interpreter gave, and the exception the launch raised."""

    def __init__(self, launcher: str = "", args: list | None = None, kwargs: dict | None = None):
        super().__init__(launcher=launcher, args=list(args or []), kwargs=dict(kwargs or {}))
        if launcher not in LAUNCHERS:
            raise wire.WireError(f"{str(launcher)[:40]!r} is not one of the course's launchers")
        self.launcher, self.args, self.kwargs = launcher, list(args or []), dict(kwargs or {})

    def measure(self, kernel: Any) -> dict:
        """In the student's kernel: launch, and report."""
        from attention_lab.bridge.kernel_side import exception_data

        watch = LoadWatch()
        # A kernel compiled for the GPU (defined without TRITON_INTERPRET: grading without the sandbox on a GPU
        # machine) runs on CUDA tensors; an interpreted one on the CPU tensors that crossed (the sandbox has no GPU).
        gpu = _compiled_for_gpu(kernel) and torch.cuda.is_available()
        there = lambda value: value.cuda() if gpu and isinstance(value, torch.Tensor) else value  # noqa: E731
        found: dict = {"result": None, "raised": None, "ran_on": "cuda" if gpu else "cpu"}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", message=_DISCARDED_VALUE_WARNINGS, category=RuntimeWarning)
            try:
                kwargs = {name: there(value) for name, value in self.kwargs.items()}
                found["result"] = globals()[self.launcher](kernel, *map(there, self.args), watch=watch, **kwargs)
            except Exception as error:  # the launch's own outcome, for the checker to judge
                found["raised"] = exception_data(error)
                found["raised"]["message"] = str(error).strip()[-2000:]  # the end: where Triton says what broke
        texts = Counter((w.category.__name__[:100], str(w.message)[:400]) for w in caught)
        found["warnings"] = [[name, text, count] for (name, text), count in texts.most_common(MAX_WARNING_TEXTS)]
        found["watch"] = watch.findings()
        return found

    def accept(self, findings: Any) -> None:
        if not (isinstance(findings, dict) and isinstance(findings.get("warnings"), list)
                and len(findings["warnings"]) <= MAX_WARNING_TEXTS):
            raise wire.WireError("a malformed report of a launch")
        result, raised = findings.get("result"), findings.get("raised")
        if findings.get("ran_on") not in ("cpu", "cuda"):
            raise wire.WireError("a launch that does not say where it ran")
        if raised is None and not (isinstance(result, torch.Tensor) or (
                isinstance(result, tuple) and result and all(isinstance(t, torch.Tensor) for t in result))):
            raise wire.WireError("a launch that returned no tensors")
        for item in findings["warnings"]:
            if not (isinstance(item, list) and len(item) == 3 and probes.strings(item[:2], limit=2)
                    and item[0].isidentifier() and type(item[2]) is int and 0 < item[2] <= MAX_WARNINGS):
                raise wire.WireError("a malformed warning")
        self.result = findings

    def replay(self, watch: LoadWatch) -> Any:
        """What the launch did, here: ``watch`` takes the kernel's watch's records, the warnings are
        given again, and the launch's result is returned (or its exception raised)."""
        from attention_lab.bridge import checker_side

        watch.accept(self.result.get("watch"))
        for name, text, count in self.result["warnings"]:
            category = _warning_class(name)
            for _ in range(count):
                warnings.warn(text, category, stacklevel=2)
        raised = self.result.get("raised")
        if raised is None:
            return self.result["result"]
        error = checker_side.student_exception(raised)
        known = _LAUNCH_ERRORS.get(str(raised.get("type")))
        if known is StoreOutOfBounds:
            raise StoreOutOfBounds(str(error).removeprefix("the kernel wrote past the end of ")[:100])
        if known is not None:
            raise known(str(error))
        raise error


def _warning_class(name: str) -> type:
    """A warning category by name: Python's own, or one made with that name (a warning's class is its name)."""
    import builtins

    known = getattr(builtins, name, None)
    if isinstance(known, type) and issubclass(known, Warning):
        return known
    if name not in _WARNING_CLASSES:
        _WARNING_CLASSES[name] = type(name, (UserWarning,), {"__module__": "student"})
    return _WARNING_CLASSES[name]


_WARNING_CLASSES: dict[str, type] = {}
