"""The rollout section of the experiment config (``RolloutConfig``, ``--rollout.*``) and its checks.

It lives with the rollout, as ``models.sharding.MeshConfig`` lives with the mesh: the meta-episode runner
is built from it (``meta_episode.RunnerConfig``) without importing the experiment config above it, and
``mage_jax.config`` makes it the ``rollout`` section of ``ExperimentConfig``. ``check_rollout`` is the one
place its values are checked (``config.validate`` and every runner call it).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from mage_jax.configtools import check, check_choices
from mage_jax.envs.prompts import MEMORY_MODES, STYLES
from mage_jax.tokenizer import WORD_PATTERN

MemoryMode = Literal[MEMORY_MODES]
PromptStyle = Literal[STYLES]
RolloutScheduling = Literal["continuous", "lockstep"]


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Meta-episode shape (docs/method.md §2) and prompt options (§3)."""

    num_tasks: int = 16
    """B: task instances per iteration."""
    group_size: int = 8
    """G: meta-episodes per task instance (one group)."""
    batch_size: int | None = None
    """Meta-episodes per iteration; optional, must equal num_tasks * group_size when given."""
    num_episodes: int = 3
    """N."""
    memory_mode: MemoryMode = "reflection_only"
    """``none``: every episode's prompt carries no memory (a no-memory control; needs ``reflect=false``)."""
    reflect: bool = True
    """Run the reflect phase between episodes (off: memory comes from trajectories only)."""
    reflection_words: tuple[str, ...] = ()
    """Constrained reflections (word-level tokenizer): each reflection is ``<remark>`` + 1 to
    ``reflection_max_words`` of these words + ``</remark>``, decoded under a token automaton and replayed
    in the log-prob recompute like constrained actions. Empty: free reflections."""
    reflection_max_words: int = 3
    prompt_style: PromptStyle = "full"
    constrained_actions: bool = False
    """Constrain play responses to the legal ``<action>...</action>`` strings (and the log-prob recompute)."""
    max_prompt_tokens: int = 4096
    max_response_tokens: int = 8192
    """Play-row generation limit."""
    max_reflection_tokens: int | None = None
    """Reflect-row generation limit; None: same as max_response_tokens."""
    max_turns: int | None = None
    """Per-episode turn limit; None: the environment's own."""
    max_decode_rows: int = 0
    """Most rows the sampler decodes at once (a larger rollout or evaluation is decoded in chunks of this
    many rows, each with its own KV cache); 0: the whole batch at once. Bounds the KV cache per device."""
    length_buckets: tuple[int, ...] = ()
    """Token-length buckets of prompts (sampler) and of prompt + response rows (training); each bucket
    compiles once. Empty: 64, 96, 128, 192, ... up to the limits."""
    privileged_reflection: bool = True
    """Training reflect prompts show the privileged text (Kuhn's both-cards quirk, docs/method.md §7.1)."""
    engine: RolloutScheduling = "continuous"
    """How the LLM calls of a rollout (training, evaluation, zero-shot baselines) are scheduled:
    ``continuous`` (the rollout engine: decode slots, a meta-episode's next prompt starts as soon as its
    response is back, identical prompts prefilled once) or ``lockstep`` (one batched call per turn)."""
    engine_slots: int = 0
    """Concurrent decode slots of the engine; 0: the largest rollout capped at ``max_decode_rows``, at
    most 64; always rounded up to the mesh's batch ways."""
    engine_chunk: int = 8
    """Decode steps between the engine's host checks (a finished row waits at most this many steps)."""
    engine_windows: int = 1
    """Decode window sizes of the engine: 1 attends over the whole KV cache every step; k > 1 adds its
    half, quarter, ... (k sizes), so a chunk whose slots all hold short prompts reads only the prefix
    they need: faster decoding at long contexts for k - 1 more decode programs per slot bucket."""

    @property
    def reflection_tokens(self) -> int:
        """The reflect-row generation limit in force: ``max_reflection_tokens``, else the play limit."""
        return self.max_reflection_tokens or self.max_response_tokens

    @property
    def max_new_tokens(self) -> int:
        """The longest response of any row (play or reflection): the sampler's and the engine's generation
        bound, and the response part of the longest training row."""
        return max(self.max_response_tokens, self.reflection_tokens)


def check_rollout(r: RolloutConfig) -> None:
    """Raise ``ConfigError`` (one line naming the key) for the first impossible rollout setting."""
    check_choices(r, "rollout.")
    check(r.num_tasks >= 1, f"rollout.num_tasks must be >= 1 (got {r.num_tasks})")
    check(r.group_size >= 1, f"rollout.group_size must be >= 1 (got {r.group_size})")
    if r.batch_size is not None:
        check(r.batch_size >= 1, f"rollout.batch_size must be >= 1 (got {r.batch_size})")
        check(r.batch_size % r.group_size == 0,
              f"rollout.group_size {r.group_size} does not divide rollout.batch_size {r.batch_size}")
        check(r.batch_size == r.num_tasks * r.group_size,
              f"rollout.batch_size {r.batch_size} != rollout.num_tasks * rollout.group_size "
              f"({r.num_tasks} * {r.group_size} = {r.num_tasks * r.group_size})")
    check(r.num_episodes >= 1, f"rollout.num_episodes must be >= 1 (got {r.num_episodes})")
    check(not (r.memory_mode not in ("history_only", "none") and not r.reflect and r.num_episodes > 1),
          f"rollout.memory_mode={r.memory_mode} needs reflections; set rollout.reflect=true or "
          "rollout.memory_mode=history_only")
    check(not (r.memory_mode == "none" and r.reflect and r.num_episodes > 1),
          "rollout.memory_mode=none shows no reflections; set rollout.reflect=false")
    _check_reflection_words(r)
    check(r.max_prompt_tokens >= 1, f"rollout.max_prompt_tokens must be >= 1 (got {r.max_prompt_tokens})")
    check(r.max_response_tokens >= 1,
          f"rollout.max_response_tokens must be >= 1 (got {r.max_response_tokens})")
    check(r.max_decode_rows >= 0, f"rollout.max_decode_rows must be >= 0 (got {r.max_decode_rows})")
    if r.max_reflection_tokens is not None:
        check(r.max_reflection_tokens >= 1, "rollout.max_reflection_tokens must be >= 1")
    if r.max_turns is not None:
        check(r.max_turns >= 1, f"rollout.max_turns must be >= 1 (got {r.max_turns})")
    check(all(b >= 1 for b in r.length_buckets), "rollout.length_buckets must be positive")
    check(r.engine_slots >= 0, f"rollout.engine_slots must be >= 0 (got {r.engine_slots})")
    check(r.engine_chunk >= 1, f"rollout.engine_chunk must be >= 1 (got {r.engine_chunk})")
    check(r.engine_windows >= 1, f"rollout.engine_windows must be >= 1 (got {r.engine_windows})")


def _check_reflection_words(r: RolloutConfig) -> None:
    """Constrained reflections: a list of distinct single words, room for the longest reflection (that
    each is one token of the vocabulary is the tokenizer's check)."""
    check(r.reflection_max_words >= 1,
          f"rollout.reflection_max_words must be >= 1 (got {r.reflection_max_words})")
    if not r.reflection_words:
        return
    check(r.reflect, "rollout.reflection_words constrain reflections; set rollout.reflect=true")
    bad = [w for w in r.reflection_words
           if not re.fullmatch(r"\w+", w) or re.findall(WORD_PATTERN, w) != [w]]
    check(not bad, f"rollout.reflection_words must be single words of letters or digits, one token each "
                   f"(got {', '.join(map(repr, bad))})")
    check(len(set(r.reflection_words)) == len(r.reflection_words),
          f"rollout.reflection_words must be distinct (got {', '.join(r.reflection_words)})")
    limit = r.reflection_tokens
    check(limit >= r.reflection_max_words + 3,
          f"rollout.max_reflection_tokens {limit} is too short for <remark>, {r.reflection_max_words} "
          f"words, </remark> and the end token; set it to >= {r.reflection_max_words + 3}")
