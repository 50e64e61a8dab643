"""The built-in environments: importing this module registers each of them (``envs.base.register_env``).

``envs.base.make_env`` / ``env_class`` / ``registered_envs`` import it on first use, so importing
``mage_jax.envs`` alone builds nothing; optional dependencies (TextWorld, bm25s) are imported only when
an environment needs them.
"""

import mage_jax.envs.alfworld  # noqa: F401  (alfworld / textworld are imported only when a game starts)
import mage_jax.envs.kuhn_poker  # noqa: F401
import mage_jax.envs.minesweeper  # noqa: F401
import mage_jax.envs.sokoban  # noqa: F401
import mage_jax.envs.tic_tac_toe  # noqa: F401
import mage_jax.envs.webshop.env  # noqa: F401  (bm25s is imported on the first search)
