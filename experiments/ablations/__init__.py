"""The paper's ablations, one module each (``python -m experiments.ablations.<name>``).

``reward_design`` (differential / cumulative / single-episode), ``anchors`` (global / local),
``grouping`` (stationary / mixed opponents in a group), ``opponent_pool`` (balanced /
pattern-skewed / single fixed opponent) and, beyond the paper, ``memory_channel`` (no memory /
constrained reflections / trajectories / both, at the tiny scale). Each runs its variants over
several seeds (``--seeds``), then writes a markdown table (mean ± standard error over seeds) and a
plot to its ``--out-dir``.
"""

ABLATIONS = ("reward_design", "anchors", "grouping", "opponent_pool", "memory_channel")
