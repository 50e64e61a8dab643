"""The experiment modules, each a command: ``python -m experiments.<name>``.

Run as a command, the package first turns a Ctrl-C during the start-up imports (JAX and the model code
take seconds) into one line instead of a traceback (``signals.one_line_startup_interrupt``).
"""

import sys

if sys.argv[:1] == ["-m"]:  # ``python -m experiments.<name>``: runpy imports this package to find the module
    from mage_jax.training.signals import one_line_startup_interrupt

    one_line_startup_interrupt()
