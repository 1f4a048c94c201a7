"""Attention Lab: helpers for the course notebooks.

Students meet three parts of this package:

* :func:`setup` (called by the first cell of every notebook) picks the device and seeds
  the random generators;
* ``attention_lab.checks.<notebook>``: the ``check_<name>`` functions that the test cells
  call right after each exercise;
* ``attention_lab.widgets``: interactive views of attention (static figures where no
  live frontend is attached).
"""

# The helpers' release: numbers only (X.Y.Z), and the one place it is written (pyproject.toml reads it
# from here). `make release` writes it into every notebook's setup cell, which reinstalls helpers older
# than its notebook's (a Colab runtime keeps what it installed): raise it when the helpers change after
# students have installed them.
__version__ = "0.1.0"

from attention_lab.device import describe_environment, pick_device, seed_everything, setup

# Imported here, by the setup cell, so that the checks' snapshot of the library functions
# they rely on is taken before any answer cell runs (see attention_lab.checking).
from attention_lab import checking as _checking  # noqa: E402,F401  isort: skip

__all__ = ["setup", "pick_device", "seed_everything", "describe_environment", "__version__"]
