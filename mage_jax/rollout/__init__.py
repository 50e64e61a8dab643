"""mage_jax.rollout."""
