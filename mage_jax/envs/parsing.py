"""Extracting actions and reflections from raw model output (spec section 3).

Parsing runs on the whole decoded response, ``<think>`` block included, and never raises: any
string (unicode, megabytes, unclosed or nested tags) yields either the extracted text or None.
Rule: the *first* opening tag and the first closing tag after it, as the reference's find-based
parsing does. A reasoning block that writes a tag pair before the real answer therefore decides
the action; that is the reference behaviour, and the model learns to avoid it.
"""

from __future__ import annotations

import re

MAX_REFLECTION_CHARS = 2000
_CELL = re.compile(r"\(\s*([+-]?\d+)\s*,\s*([+-]?\d+)\s*\)")
_MAX_COORDINATE_DIGITS = 6


def extract_tagged(text: str, tag: str) -> str | None:
    """Text between the first ``<tag>`` and the first ``</tag>`` after it, stripped; None if absent."""
    if not isinstance(text, str):
        return None
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    start = text.find(open_tag)
    if start < 0:
        return None
    start += len(open_tag)
    end = text.find(close_tag, start)
    if end < 0:
        return None
    return text[start:end].strip()


def extract_action(response: str) -> str | None:
    """The text inside ``<action>...</action>``, or None (an invalid turn)."""
    return extract_tagged(response, "action")


def extract_reflection(response: str) -> tuple[str, bool]:
    """(reflection, valid): the ``<remark>`` text capped at 2000 characters; missing tags -> ("", False)."""
    text = extract_tagged(response, "remark")
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
