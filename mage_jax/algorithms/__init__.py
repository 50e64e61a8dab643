"""mage_jax.algorithms."""
