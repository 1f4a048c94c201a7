"""Attention Lab: helpers for the course notebooks.

Students meet three parts of this package:

* :func:`setup` (called by the first cell of every notebook) picks the device and seeds
  the random generators;
* ``attention_lab.checks.<notebook>``: the ``check_<name>`` functions that the test cells
  call right after each exercise;
* ``attention_lab.widgets``: interactive views of attention (static figures where no
  live frontend is attached).
"""

from attention_lab.version import __version__  # the helpers' release: raise it in version.py
from attention_lab.device import describe_environment, pick_device, seed_everything, setup

# Imported here, by the setup cell, so that the checks' snapshot of the library functions
# they rely on is taken before any answer cell runs (see attention_lab.checking).
from attention_lab import checking as _checking  # noqa: E402,F401  isort: skip

__all__ = ["setup", "pick_device", "seed_everything", "describe_environment", "__version__"]
