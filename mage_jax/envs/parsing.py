"""Extracting actions and reflections from raw model output (docs/method.md §3).

Parsing never raises: any string (unicode, megabytes, unclosed or nested tags) yields either the
extracted text or None. One rule for every environment:

1. the reasoning is set aside: every closed ``<think>...</think>`` block is removed, and a
   ``</think>`` without an opening tag before it (a chat template that opens the block in the
   prompt) ends the reasoning, so only the text after it counts;
2. in what remains, the *last* complete ``<tag>...</tag>`` pair is the answer.

A thinking model mentions tags while it reasons ("maybe <action>BET</action>? no..."), and it may
restate the answer; the final answer is the last tag pair outside the reasoning. The reference takes
the last pair for Tic-Tac-Toe, ALFWorld and WebShop and the first for Kuhn Poker and Sokoban, on
the whole response; docs/deviations.md lists the difference. An unclosed ``<think>`` block (a
response cut at the length limit) is kept as text.
"""

from __future__ import annotations

import re

MAX_REFLECTION_CHARS = 2000
_CELL = re.compile(r"\(\s*([+-]?\d+)\s*,\s*([+-]?\d+)\s*\)")
_MAX_COORDINATE_DIGITS = 6
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def strip_thinking(text: str) -> str:
    """``text`` without its closed ``<think>...</think>`` blocks and without anything before a
    ``</think>`` that has no opening tag (linear time, any input)."""
    parts, position = [], 0
    while True:
        start = text.find(_THINK_OPEN, position)
        end = -1 if start < 0 else text.find(_THINK_CLOSE, start + len(_THINK_OPEN))
        if end < 0:
            parts.append(text[position:])
            break
        parts.append(text[position:start])
        position = end + len(_THINK_CLOSE)
    visible = "".join(parts)
    unopened = visible.rfind(_THINK_CLOSE)
    return visible if unopened < 0 else visible[unopened + len(_THINK_CLOSE):]


def extract_tagged(text: str, tag: str) -> str | None:
    """Text of the last complete ``<tag>...</tag>`` pair of ``text``, stripped; None if there is none.

    The pair is the last ``<tag>`` before the last ``</tag>``, closed by the first ``</tag>`` after it
    (so the text never holds a closing tag), and a trailing unclosed ``<tag>`` (a cut-off
    restatement) leaves the earlier complete answer in force.
    """
    if not isinstance(text, str):
        return None
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    end = text.rfind(close_tag)
    if end < 0:
        return None
    start = text.rfind(open_tag, 0, end)
    if start < 0:
        return None
    end = text.find(close_tag, start + len(open_tag))
    return text[start + len(open_tag):end].strip()


def extract_action(response: str) -> str | None:
    """The answer's ``<action>...</action>`` text (rule in the module docstring); None: an invalid turn."""
    if not isinstance(response, str):
        return None
    return extract_tagged(strip_thinking(response), "action")


def extract_reflection(response: str) -> tuple[str, bool]:
    """(reflection, valid): the answer's ``<remark>`` text capped at 2000 characters; missing tags ->
    ("", False)."""
    text = extract_tagged(strip_thinking(response), "remark") if isinstance(response, str) else None
    if text is None:
        return "", False
    return text[:MAX_REFLECTION_CHARS], True


def extract_cell(text: str) -> tuple[int, int] | None:
    """The first ``(int, int)`` pair of an action text (grid games, 1-based as written), or None.

    Numbers longer than 6 digits come back as a huge out-of-range value instead of being converted
    (Python refuses int() of very long digit strings), so range checks still reject them.
    """
    if not isinstance(text, str):
        return None
    match = _CELL.search(text)
    if match is None:
        return None

    def number(digits: str) -> int:
        body = digits.lstrip("+-")
        if len(body) > _MAX_COORDINATE_DIGITS:
            return -(10**_MAX_COORDINATE_DIGITS) if digits.startswith("-") else 10**_MAX_COORDINATE_DIGITS
        return int(digits)

    return number(match.group(1)), number(match.group(2))
