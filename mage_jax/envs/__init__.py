"""Text environments (plain Python, no JAX): the protocol, the registry and the built-in tasks.

Importing this package registers every built-in environment whose dependencies are installed.
"""

from mage_jax.envs.base import (
    PromptSpec,
    StepInfo,
    StepResult,
    TextEnv,
    env_class,
    make_env,
    register_env,
    registered_envs,
)

__all__ = [
    "PromptSpec",
    "StepInfo",
    "StepResult",
    "TextEnv",
    "env_class",
    "make_env",
    "register_env",
    "registered_envs",
]

# Built-in environments register themselves on import (added as they land).
import mage_jax.envs.alfworld  # noqa: E402,F401  (alfworld / textworld are imported only when a game starts)
import mage_jax.envs.kuhn_poker  # noqa: E402,F401
import mage_jax.envs.minesweeper  # noqa: E402,F401
import mage_jax.envs.sokoban  # noqa: E402,F401
import mage_jax.envs.tic_tac_toe  # noqa: E402,F401
import mage_jax.envs.webshop  # noqa: E402,F401  (bm25s is imported on the first search)
