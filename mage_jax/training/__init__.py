"""mage_jax.training."""
