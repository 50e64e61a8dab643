"""mage_jax: MAGE meta-reinforcement learning of LLM agents in JAX/Flax.

Importing the package is cheap: subpackages (models, envs, training, ...) are imported on demand,
and optional heavy libraries (OpenSpiel, TextWorld, torch) only where they are used.
"""

__version__ = "0.1.0"
