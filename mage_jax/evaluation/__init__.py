"""mage_jax.evaluation."""
