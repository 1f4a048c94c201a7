"""Device selection, seeding and the environment line every notebook prints first."""

from __future__ import annotations

import os
import platform
import random

import numpy as np
import torch

DEVICE_ENV_VAR = "ATTENTION_LAB_DEVICE"


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
    """One line naming the versions and the device, for bug reports and screenshots."""
    if device.type == "cuda":
        where = f"CUDA ({torch.cuda.get_device_name(device)})"
    else:
        where = f"CPU ({torch.get_num_threads()} threads)"
    return (
        f"Attention Lab | Python {platform.python_version()} | torch {torch.__version__} | "
        f"numpy {np.__version__} | device: {where}"
    )


def setup(seed: int = 0, preferred: str | None = None, verbose: bool = True) -> torch.device:
    """What the first cell of every notebook calls: pick the device, seed, print versions.

    Without a CUDA GPU, Triton kernels (notebook 06) run in Triton's interpreter, which
    ``@triton.jit`` chooses when ``TRITON_INTERPRET=1`` is set before the kernel is defined.
    """
    device = pick_device(preferred)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    seed_everything(seed)
    if verbose:
        print(describe_environment(device))
    return device
