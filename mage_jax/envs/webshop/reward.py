"""The WebShop purchase score (docs/method.md §7.6), implemented from the WebShop paper's description.

A purchase of product ``Y`` with chosen option values ``Y_opt`` at price ``p`` against a goal ``U``
(wanted attributes ``U_att``, wanted option values ``U_opt``, price limit ``u_price``) scores

    r = (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[p <= u_price]) / (|U_att| + |U_opt| + 1) · r_type

and the episode is a success only when r = 1 (env reward 10). The precise rules used here:

* **Attribute match** — a wanted attribute counts once if (a) it *token-matches* one of the product's
  attributes, or else (b) it occurs as a lowercase substring of the product's title, bullet points
  or description.
* **Option match** — a wanted option value counts once if it token-matches one of the chosen option
  values (options the buyer did not select never match).
* **Token match** — lowercase alphanumeric token sets ``A`` and ``B`` match when they share a token
  and one contains the other (``"lavender"`` matches ``"lavender scent"``; ``"red"`` does not match
  ``"dark blue"``). This is exactly "token-set ratio = 100" of fuzzy matching; the reference uses
  "ratio > 85", which also admits near-misspellings — we prefer an exact, dependency-free rule.
* **Price** — 1 when the price paid is at most the goal's limit.
* **Type factor r_type** from three signals: ``query_match`` (the product was listed under the same
  search query as the goal's product), ``category_match`` (the two category paths, split on "›",
  share at least two levels) and ``title_score`` = |T_Y ∩ T_U| / |T_U|, where T are the *type words*
  of the product name and of the goal product's name: lowercase alphanumeric tokens that are not
  stop words and not pure numbers (the reference keeps the nouns found by a part-of-speech tagger;
  content words need no language model). Then, in this order::

      r_type = 1.0
      if not (query_match or category_match or title_score > 0.2): r_type = 0.5
      if title_score < 0.1: r_type = 0.1
      if title_score == 0:  r_type = 0.0

  A goal name with no type words gives title_score 0.2.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "PurchaseScore",
    "STOP_WORDS",
    "purchase_score",
    "title_score",
    "token_match",
    "type_factor",
    "type_words",
]

SUCCESS_TOLERANCE = 1e-9

_WORD = re.compile(r"[a-z0-9]+")

# Function words and shop filler; never type words.
STOP_WORDS = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "has", "have", "in", "into", "is",
    "it", "its", "of", "on", "or", "per", "s", "so", "that", "the", "their", "this", "to", "with",
    "without", "x", "pack", "count", "inch", "inches", "oz", "ounce", "ounces", "fl", "lb", "lbs",
    "pound", "pounds", "set", "piece", "pieces"
})


def _tokens(text: str) -> set[str]:
    return set(_WORD.findall(str(text).lower()))


def token_match(a: str, b: str) -> bool:
    """Token sets share a token and one contains the other (the "token-set ratio = 100" rule)."""
    ta, tb = _tokens(a), _tokens(b)
    return bool(ta & tb) and (ta <= tb or tb <= ta)


def type_words(name: str) -> set[str]:
    """Content words of a product name: tokens that are neither stop words nor pure numbers."""
    return {t for t in _tokens(name) if t not in STOP_WORDS and not t.isdigit()}


def title_score(purchased_name: str, goal_name: str) -> float:
    """Share of the goal name's type words found in the purchased name (0.2 when the goal has none)."""
    wanted = type_words(goal_name)
    if not wanted:
        return 0.2
    return len(type_words(purchased_name) & wanted) / len(wanted)


def _category_levels(path: str) -> set[str]:
    return {level.strip().lower() for level in str(path).split("›") if level.strip()}


def type_factor(query_match: bool, category_match: bool, title: float) -> float:
    """r_type from the three type signals (rules in the module docstring)."""
    r_type = 1.0
    if not (query_match or category_match or title > 0.2):
        r_type = 0.5
    if title < 0.1:
        r_type = 0.1
    if title == 0.0:
        r_type = 0.0
    return r_type


@dataclasses.dataclass(frozen=True)
class PurchaseScore:
    """The score of one purchase and every term that made it (recorded in ``StepInfo.extra``)."""

    attribute_matches: int
    num_attributes: int
    option_matches: int
    num_options: int
    price_ok: bool
    query_match: bool
    category_match: bool
    title_score: float
    r_type: float
    score: float

    @property
    def success(self) -> bool:
        return self.score >= 1.0 - SUCCESS_TOLERANCE

    def as_dict(self) -> dict[str, float | int | bool]:
        return {**dataclasses.asdict(self), "success": self.success}


def _attribute_present(attribute: str, product_attributes: Sequence[str], text: str) -> bool:
    if any(token_match(attribute, have) for have in product_attributes):
        return True
    wanted = attribute.strip().lower()
    return bool(wanted) and wanted in text


def purchase_score(
    *,
    product_name: str,
    product_query: str,
    product_category: str,
    product_attributes: Sequence[str],
    product_text: str,
    chosen_options: Iterable[str],
    price: float,
    goal_name: str,
    goal_query: str,
    goal_category: str,
    goal_attributes: Sequence[str],
    goal_options: Sequence[str],
    price_upper: float,
) -> PurchaseScore:
    """Score one purchase (module docstring). ``product_text`` is title + bullet points + description,
    searched for attributes the product does not list; ``chosen_options`` are the selected values."""
    text = str(product_text).lower()
    chosen = [str(v) for v in chosen_options]
    att = sum(_attribute_present(str(a), product_attributes, text) for a in goal_attributes)
    opt = sum(any(token_match(str(o), c) for c in chosen) for o in goal_options)
    price_ok = float(price) <= float(price_upper)
    query_match = str(product_query).strip().lower() == str(goal_query).strip().lower()
    category_match = len(_category_levels(product_category) & _category_levels(goal_category)) >= 2
    title = title_score(product_name, goal_name)
    r_type = type_factor(query_match, category_match, title)
    total = (att + opt + int(price_ok)) / (len(goal_attributes) + len(goal_options) + 1) * r_type
    return PurchaseScore(
        attribute_matches=att,
        num_attributes=len(goal_attributes),
        option_matches=opt,
        num_options=len(goal_options),
        price_ok=price_ok,
        query_match=query_match,
        category_match=category_match,
        title_score=title,
        r_type=r_type,
        score=total,
    )


def goal_option_values(goal_options: Mapping[str, str] | Sequence[str] | None) -> tuple[str, ...]:
    """U_opt as a tuple of values: goals name their options (``{"size": "m"}``) or list values only."""
    if goal_options is None:
        return ()
    if isinstance(goal_options, Mapping):
        return tuple(str(v) for v in goal_options.values())
    if isinstance(goal_options, str):
        return (goal_options,)
    return tuple(str(v) for v in goal_options)
