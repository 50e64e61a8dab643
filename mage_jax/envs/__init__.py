"""Text environments (plain Python, no JAX): the protocol and registry (``envs.base``) and the
built-in tasks, one module each. ``envs.base.make_env`` imports ``envs.builtin`` (every built-in
environment registers itself there) the first time it is called."""
