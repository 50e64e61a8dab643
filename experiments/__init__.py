"""The experiment modules, each a command: ``python -m experiments.<name>``.

Run as a command, the package first turns a Ctrl-C during the start-up imports (JAX and the model code
take seconds) into one line instead of a traceback, and keeps a signal during the command's exit from
printing one (``mage_jax.training.signals.command_process``).
"""

import sys

if sys.argv[:1] == ["-m"]:  # ``python -m experiments.<name>``: runpy imports this package to find the module
    from mage_jax.training.signals import command_process

    command_process()
