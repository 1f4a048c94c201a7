"""Device selection, seeding and the environment line every notebook prints first."""

from __future__ import annotations

import os
import platform
import random

import numpy as np
import torch

from attention_lab.frontend import fallback_note, installed_version
from attention_lab.progress import use_course_progress_bars
from attention_lab.version import __version__

DEVICE_ENV_VAR = "ATTENTION_LAB_DEVICE"
# The backend a Jupyter kernel sets in MPLBACKEND unless the user chose another one.
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"


def pick_device(preferred: str | None = None) -> torch.device:
    """The device the course runs on: CUDA when present, else CPU.

    ``preferred`` (or the ``ATTENTION_LAB_DEVICE`` environment variable) overrides the
    choice, e.g. ``"cpu"`` to reproduce a CPU-only grading run on a GPU machine.
    """
    choice = preferred or os.environ.get(DEVICE_ENV_VAR)
    if choice:
        device = torch.device(choice)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {choice!r} was asked for, but CUDA is not available here")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and PyTorch (all devices) so a notebook's printed numbers repeat."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def describe_environment(device: torch.device) -> str:
    """One line naming the versions and the device, for bug reports and screenshots: the helpers'
    own, and Triton's and ipywidgets' (the two a runtime may lack or have in another version)."""
    if device.type == "cuda":
        where = f"CUDA ({torch.cuda.get_device_name(device)})"
    else:
        where = f"CPU ({torch.get_num_threads()} threads)"
    optional = " | ".join(f"{name} {installed_version(name) or 'not installed'}" for name in ("triton", "ipywidgets"))
    return (
        f"Attention Lab {__version__} | Python {platform.python_version()} | torch {torch.__version__} | "
        f"numpy {np.__version__} | {optional} | device: {where}"
    )


def show_figures_inline() -> None:
    """In a Jupyter kernel whose backend is the inline one, activate it now (``%matplotlib inline``).

    IPython 9 with Matplotlib older than 3.9 activates the inline backend only after the
    first figure has been shown, so that figure comes out as text
    (``<Figure size 1000x200 with 10 Axes>``). Activating it before any figure fixes that;
    on newer versions it changes nothing. A backend the user chose (MPLBACKEND=Agg, as the
    tests set) is left alone, and so is a plain Python or terminal IPython session.
    """
    if os.environ.get("MPLBACKEND", INLINE_BACKEND) != INLINE_BACKEND:
        return
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and getattr(shell, "kernel", None) is not None:
        shell.run_line_magic("matplotlib", "inline")


def setup(seed: int = 0, preferred: str | None = None, verbose: bool = True) -> torch.device:
    """What the first cell of every notebook calls: pick the device, seed, print versions.

    Without a CUDA GPU, Triton kernels (notebook 06) run in Triton's interpreter, which
    ``@triton.jit`` chooses when ``TRITON_INTERPRET=1`` is set before the kernel is defined.
    Progress bars (``tqdm.auto``) become the course's, which read right where widgets do not
    draw (:mod:`attention_lab.progress`).
    """
    device = pick_device(preferred)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    seed_everything(seed)
    show_figures_inline()
    use_course_progress_bars()
    if verbose:
        print(describe_environment(device))
        note = fallback_note()
        if note:
            print(note)
    return device
