"""Attention Lab: helpers for the course notebooks.

Students meet three parts of this package:

* :func:`setup` (called by the first cell of every notebook) picks the device and seeds
  the random generators;
* ``attention_lab.checks.<notebook>``: the ``check_<name>`` functions that the test cells
  call right after each exercise;
* ``attention_lab.widgets``: interactive views of attention (static figures where no
  live frontend is attached).
"""

from attention_lab.device import describe_environment, pick_device, seed_everything, setup

__version__ = "0.1.0"

__all__ = ["setup", "pick_device", "seed_everything", "describe_environment", "__version__"]
