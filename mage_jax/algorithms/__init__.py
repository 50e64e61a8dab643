"""Pure-JAX credit assignment and losses of MAGE (docs/method.md §4-5).

``returns``: the row batch, meta-rewards d_n, row scores e and step returns G; ``advantages``: the
estimator registry (gigpo, grpo, rloo); ``losses``: PPO dual-clip loss, KL estimators, entropy and
chunked token log-probs.
"""
