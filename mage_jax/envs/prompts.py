"""Play and reflect prompts and the memory of earlier episodes (docs/method.md §3).

This is the only place that turns episodes into prompt text: every environment provides a
``PromptSpec`` (its preamble, action format and history window W) and the runner keeps ``Move`` and
``EpisodeRecord`` values; the layout below is shared by all environments.

Two styles carry the same information:

* ``"full"`` — readable English for pretrained LLMs (thinking mode), ends with "think step by step,
  then answer inside <action>...</action>" (or ``<remark>`` for reflections);
* ``"compact"`` — a terse, word-level layout for tiny models trained from scratch: no decorative
  words, every number and symbol a separate whitespace-delimited token (``compact_text``), so a
  word-level vocabulary built from rendered prompts covers every observation.

A serialized trajectory always shows each move's action, its observation and the episode's final
reward and outcome: a model can only adapt across episodes if it can see how the earlier ones ended.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from mage_jax.envs.base import PromptSpec

MEMORY_MODES = ("reflection_only", "history_only", "history_and_reflection", "none")
"""What later episodes carry from earlier ones; ``none`` carries nothing (a no-memory control: the
agent plays N episodes but cannot adapt across them)."""
STYLES = ("full", "compact")


@dataclasses.dataclass(frozen=True)
class Move:
    """One play turn of an episode as the prompt shows it."""

    action: str | None
    """The canonical action as applied (``StepResult.action``); None for an invalid turn."""
    observation: str
    """The raw observation after the turn (opponent's answer applied)."""
    reward: float
    valid: bool = True


@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
    """A finished episode: its moves, total reward, outcome and the reflection written after it."""

    moves: tuple[Move, ...]
    reward: float
    won: bool
    reflection: str | None = None
    episode: int | None = None
    """0-based index of this episode in its meta-episode; None means its position in the memory list.
    Set it whenever memory may be trimmed (dropping the oldest entries must not renumber the rest)."""


# ------------------------------------------------------------------------------------------------
# Small text helpers


# A sign belongs to a number only when it does not follow a word ("reward -0.1", "+10", not "row-1").
# XML-like tags (``<action>``) stay whole.
_TAG = r"</?[A-Za-z_][A-Za-z0-9_\-]*>"
_TOKEN = re.compile(_TAG + r"|(?<!\w)[-+]\d+(?:\.\d+)?|\d+(?:\.\d+)?|[^\W\d_]+(?:'[^\W\d_]+)*|\S")
_GRID_TOKEN = re.compile(_TAG + r"|\d+|\S")


def compact_text(text: str, *, board: bool = False) -> str:
    """Split every line into words, numbers and single symbols joined by one space; keep line breaks.

    With ``board=True`` (observations), a line without any whitespace is a board row (``"0:#_OXP"``,
    ``"XXO"``): every character of it is a token (digit runs stay whole). Other lines (and all lines
    of other text, such as actions like ``BET``) split into words, numbers and symbols:
    ``"(1, 2) reward -0.1"`` -> ``"( 1 , 2 ) reward -0.1"``. Idempotent, so it may be applied to
    text that is already compact (for example a reflection a compact model wrote).
    """
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        pattern = _GRID_TOKEN if board and not any(ch.isspace() for ch in line) else _TOKEN
        out.append(" ".join(pattern.findall(line)))
    return "\n".join(out)


def format_reward(reward: float) -> str:
    """Short, stable reward text: ``-0.1``, ``10.9``, ``10``, ``0`` (never ``-0`` or float noise)."""
    text = f"{float(reward):.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _check_options(memory_mode: str | None, style: str) -> None:
    if memory_mode is not None and memory_mode not in MEMORY_MODES:
        raise ValueError(f"unknown memory_mode {memory_mode!r}; known: {', '.join(MEMORY_MODES)}")
    if style not in STYLES:
        raise ValueError(f"unknown prompt style {style!r}; known: {', '.join(STYLES)}")


def _outcome_full(record: EpisodeRecord) -> str:
    return "successfully completed" if record.won else "NOT successfully completed"


def _outcome_compact(record: EpisodeRecord) -> str:
    return "win" if record.won else "fail"


# ------------------------------------------------------------------------------------------------
# Moves and trajectories


def _render_move(turn: int, move: Move, with_observation: bool, style: str, current: bool = False) -> str:
    """One turn: action (and reward plus observation when ``with_observation``); ``current`` marks the
    last move of a play prompt, whose observation is the state the model acts on."""
    valid = move.valid and move.action is not None
    if style == "compact":
        action = (compact_text(move.action) or "none") if valid else "invalid"
        if not with_observation:
            return f"turn {turn} : {action}"
        return (
            f"turn {turn} : {action} ; reward {format_reward(move.reward)} ; obs :\n"
            f"{compact_text(move.observation, board=True)}"
        )
    action = f'action "{move.action}"' if valid else "invalid action (nothing changed)"
    if not with_observation:
        return f"Turn {turn}: {action}"
    label = "Observation after it (the current state)" if current else "Observation after it"
    return f"Turn {turn}: {action}, reward {format_reward(move.reward)}. {label}:\n{move.observation}"


def _render_moves(moves: Sequence[Move], window: int, full_observations: int, style: str,
                  mark_current: bool = False) -> list[str]:
    """The last ``window`` moves, numbered by their turn in the episode; the most recent
    ``full_observations`` of them with reward and observation, older ones with the action only."""
    window = max(int(window), 0)
    shown = list(moves)[-window:] if window else []
    first_turn = len(moves) - len(shown) + 1
    lines = []
    for i, move in enumerate(shown):
        recent = i >= len(shown) - full_observations
        current = mark_current and i == len(shown) - 1
        lines.append(_render_move(first_turn + i, move, recent, style, current))
    return lines


def render_trajectory(record: EpisodeRecord, episode: int, *, style: str = "full",
                      window: int | None = None) -> str:
    """A finished episode: every move (or the last ``window``) with its action, reward and
    observation, then the outcome and total reward. Used by history memory and reflect prompts."""
    _check_options(None, style)
    moves = record.moves
    window = len(moves) if window is None else window
    lines = _render_moves(moves, window, full_observations=len(moves), style=style)
    skipped = len(moves) - len(lines)
    if style == "compact":
        head = f"trial {episode + 1} :"
        tail = f"trial {episode + 1} end : {_outcome_compact(record)} ; reward {format_reward(record.reward)}"
        if not moves:
            lines = ["no moves"]
        return "\n".join([head, *lines, tail])
    if not moves:
        head = f"Trial #{episode + 1}: no moves were made."
    elif skipped:
        head = f"Trial #{episode + 1}, its last {len(lines)} of {len(moves)} turns:"
    else:
        head = f"Trial #{episode + 1}, turn by turn:"
    tail = (
        f"End of trial #{episode + 1}: the task was {_outcome_full(record)}; "
        f"total reward {format_reward(record.reward)}."
    )
    return "\n".join([head, *lines, tail])


def render_memory(memory: Sequence[EpisodeRecord], *, memory_mode: str = "reflection_only",
                  style: str = "full") -> str:
    """What the next episode carries from the earlier ones (docs/method.md §3, item 3); "" when empty
    (and always with ``memory_mode="none"``)."""
    _check_options(memory_mode, style)
    if memory_mode == "none":
        return ""
    blocks = []
    for position, record in enumerate(memory):
        k = position if record.episode is None else record.episode
        parts = []
        if memory_mode in ("history_only", "history_and_reflection"):
            parts.append(render_trajectory(record, k, style=style))
        reflection = (record.reflection or "").strip()
        if memory_mode == "reflection_only":
            if style == "compact":
                text = compact_text(reflection) or "none"
                parts.append(f"trial {k + 1} : {_outcome_compact(record)} ; reflection : {text}")
            else:
                parts.append(
                    f"On trial #{k + 1} the task was {_outcome_full(record)}. "
                    f"Your reflection: {reflection or '(none)'}"
                )
        elif memory_mode == "history_and_reflection":
            if style == "compact":
                parts.append(f"trial {k + 1} reflection : {compact_text(reflection) or 'none'}")
            else:
                parts.append(f"Your reflection on trial #{k + 1}: {reflection or '(none)'}")
        blocks.append("\n".join(parts))
    if not blocks:
        return ""
    if style == "compact":
        return "memory :\n" + "\n".join(blocks)
    return "Your memory of the earlier trials of this task:\n" + "\n\n".join(blocks)


# ------------------------------------------------------------------------------------------------
# Prompts


def _preamble(spec: PromptSpec, style: str) -> str:
    return compact_text(spec.compact_preamble) if style == "compact" else spec.preamble.strip()


def _answer_format(spec: PromptSpec) -> str:
    """``spec.action_format`` with its tags (environments may give the bare format, e.g. ``(row, col)``)."""
    fmt = spec.action_format.strip()
    return fmt if "<action>" in fmt else f"<action>{fmt}</action>"


def _initial(initial_observation: str, style: str) -> str:
    if style == "compact":
        return "start :\n" + compact_text(initial_observation, board=True)
    return "The initial state of the task (the same at the start of every trial):\n" + initial_observation


def render_play_prompt(spec: PromptSpec, initial_observation: str, memory: Sequence[EpisodeRecord],
                       episode: int, moves: Sequence[Move], *, memory_mode: str = "reflection_only",
                       admissible: Sequence[str] | None = None, style: str = "full") -> str:
    """The prompt of one play turn of episode ``episode`` (0-based) after ``moves`` of it.

    Sections: preamble; initial observation; memory of ``memory`` (episodes 0..episode-1); the
    current episode's last W moves (observations for the most recent ``spec.recent_full_observations``);
    the admissible actions when given; the output instruction.
    """
    _check_options(memory_mode, style)
    sections = [_preamble(spec, style), _initial(initial_observation, style)]
    mem = render_memory(memory, memory_mode=memory_mode, style=style)
    if mem:
        sections.append(mem)
    lines = _render_moves(moves, spec.history_window, spec.recent_full_observations, style, mark_current=True)
    if style == "compact":
        current = [f"trial {episode + 1} now :", *(lines or ["no moves"])]
    elif not moves:
        current = [f"Currently on trial #{episode + 1}. No moves yet: the state is the initial state above."]
    else:
        partial = len(lines) < len(moves)
        shown = f"your last {len(lines)} of {len(moves)} turns" if partial else "your turns so far"
        current = [f"Currently on trial #{episode + 1}; {shown}:", *lines]
    sections.append("\n".join(current))
    if admissible is not None:
        if style == "compact":
            sections.append("admissible : " + " | ".join(compact_text(a) for a in admissible))
        else:
            sections.append("Admissible actions: " + ", ".join(admissible))
    answer = _answer_format(spec)
    if style == "compact":
        sections.append("answer " + compact_text(answer))
    else:
        sections.append(f"It is your turn. Think step by step, then give your action as {answer}.")
    return "\n\n".join(sections)


def render_reflect_prompt(spec: PromptSpec, initial_observation: str, last: EpisodeRecord, episode: int, *,
                          style: str = "full", privileged: str | None = None) -> str:
    """The reflection prompt written after episode ``episode`` (0-based), whose record is ``last``.

    Shows the last W moves of that episode, each with its observation, its outcome, optional
    ``privileged`` text (Kuhn's training quirk), and asks for a concise better plan in ``<remark>``.
    """
    _check_options(None, style)
    sections = [_preamble(spec, style), _initial(initial_observation, style)]
    sections.append(render_trajectory(last, episode, style=style, window=spec.history_window))
    if privileged:
        if style == "compact":
            sections.append("revealed : " + compact_text(privileged, board=True))
        else:
            sections.append("Revealed after the trial: " + privileged.strip())
    if style == "compact":
        sections.append(
            f"trial {episode + 1} {_outcome_compact(last)} . find mistakes . plan better\n"
            "answer <remark> plan </remark>"
        )
    else:
        sections.append(
            f"The task was {_outcome_full(last)} on trial #{episode + 1}. Review the trial: find the "
            "mistakes you made, then make a concise, better plan for the next trial. Think step by step, "
            "then put your reflection inside <remark>...</remark>."
        )
    return "\n\n".join(sections)
