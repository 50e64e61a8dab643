"""XLA compile options of the train step's programs: the one place they are chosen, per platform.

On CPU this jaxlib sends dots (and some reductions) to YNNPACK library fusions by default. On the
train step's own products XLA's Eigen dots are faster here (measured in ``docs/performance.md``).
The option only picks which kernels run; the result is the same float32 arithmetic up to summation
order (``tests/training/test_xla_options.py`` checks the gradients against the default compile).
Other platforms get no options.
"""

from __future__ import annotations

import jax

CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
"""Library fusions off: XLA's own (Eigen) dots and fused loops instead of YNNPACK's."""


def train_step_compiler_options(platform: str | None = None) -> dict[str, str] | None:
    """``compiler_options`` for ``jax.jit`` of the train step's programs on ``platform`` (default:
    JAX's default backend); None where the defaults are kept."""
    platform = platform or jax.default_backend()
    return dict(CPU_OPTIONS) if platform == "cpu" else None
