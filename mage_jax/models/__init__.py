"""mage_jax.models."""
