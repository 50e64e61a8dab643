"""The WebShop environment (docs/method.md §7.6): a text shopping site with search, result pages, item pages,
options and a purchase scored by WebShop's attribute / option / price / type matching.

Pages and what can be clicked on them (clicks are case-insensitive; ``legal_actions`` lists them):

* **search** — the instruction and a search bar: ``search[<query>]`` (the only page with a search bar);
* **results** — 10 products per page of the best 50 BM25 matches: ``click[back to search]``,
  ``click[next >]`` / ``click[< prev]`` between pages, ``click[<asin>]`` opens an item;
* **item** — title, price, option values grouped by option name, ``click[<value>]`` selects a value
  (replacing the earlier choice of that option), ``click[description]`` / ``click[features]`` /
  ``click[reviews]`` open sub-pages, ``click[< prev]`` returns to the results, ``click[buy now]`` buys;
* **sub-page** — the text, ``click[< prev]`` back to the item (selected options kept).

Anything else (another verb, a click on something not on the page, a search away from the search
page, an empty or over-long query) is an invalid turn: nothing changes. Buying ends the episode;
the score r in [0, 1] is ``reward.purchase_score`` and the environment reward is 10 when r = 1 (a
success), else 0. ``restart()`` returns to the search page with the *same* goal (the reference
switches to a random goal after a failed purchase; docs/method.md §11).

Observations use WebShop's text layout (page elements joined by " [SEP] "), and every page but the
search page repeats the instruction, as the reference does. Sub-page text is capped at
``page_text_chars`` and the admissible list at ``admissible_chars`` (policy in
``mage_jax.envs.admissible``: purchase and options first, then items, then navigation).
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any, ClassVar

from mage_jax.envs.admissible import fit_admissible
from mage_jax.envs.base import PromptSpec, StepInfo, StepResult, TextEnv, register_env
from mage_jax.envs.webshop.catalogue import NUM_TEST_GOALS, Catalogue, Goal, Product, load_catalogue
from mage_jax.envs.webshop.reward import PurchaseScore, purchase_score

__all__ = ["SPLITS", "HELD_OUT_SPLITS", "WebShopEnv", "webshop_prompt_spec"]

SPLITS = ("train", "test", "all")
HELD_OUT_SPLITS = ("test",)
SUCCESS_REWARD = 10.0
SEP = " [SEP] "
SEARCH_TEMPLATE = "search[<your query>]"
BACK, NEXT, PREV = "back to search", "next >", "< prev"
DETAILS = ("description", "features", "reviews")
BUY = "buy now"
MAX_QUERY_CHARS = 300

_ACTION = re.compile(r"(search|click)\s*\[(.*)\]", re.IGNORECASE | re.DOTALL)
_SPACES = re.compile(r"\s+")


def _key(text: str) -> str:
    return _SPACES.sub(" ", text.strip().lower())


def webshop_prompt_spec(max_turns: int) -> PromptSpec:
    return PromptSpec(
        preamble=(
            "You are shopping on WebShop, a text web store, for the product described in the "
            "instruction. Pages show their elements separated by [SEP].\n"
            "On the search page, search with search[your query]. On a results page, click a product "
            "code to open it, or use click[next >], click[< prev] and click[back to search]. On a "
            "product page, click an option value to select it (one value per option), click[description], "
            "click[features] or click[reviews] to read more, click[< prev] to go back, and click[buy now] "
            "to buy the product with the selected options.\n"
            "The purchase is scored from 0 to 1 on the wanted attributes, the wanted option values, the "
            "price limit and the product type; only a perfect score of 1 completes the task (reward 10). "
            f"Buying ends the trial; you have {max_turns} actions. Every trial starts from the search page "
            "with the same instruction.\n"
            "Action format: <action>search[wireless earbuds]</action> or <action>click[buy now]</action>; "
            "choose one of the admissible actions."
        ),
        compact_preamble=(
            "webshop . buy the product of the instruction . search[ query ] on search page . "
            "click[ item ] opens item . click[ value ] selects option . click[ buy now ] buys . "
            "score 1 wins reward 10"
        ),
        action_format=(
            "one admissible action in <action>...</action>, e.g. <action>search[red running shoes]</action>"
        ),
        history_window=5,
    )


@dataclasses.dataclass(frozen=True)
class _Page:
    """The browsing state; replaced (never mutated) on every valid click, so invalid turns change nothing."""

    kind: str  # search | results | item | detail | done
    query: str = ""
    results: tuple[int, ...] = ()
    page: int = 1
    item: int | None = None
    detail: str | None = None
    selected: tuple[tuple[str, str], ...] = ()
    purchase: PurchaseScore | None = None


@register_env("webshop")
class WebShopEnv(TextEnv):
    """One meta-episode of WebShop on the goal of one seed (single agent: no opponent, no seat).

    Options: ``data_dir`` (None: the generated catalogue; else a folder with the official files),
    ``split`` ("train", "test" = held out, "all"), ``size`` / ``num_products`` / ``human_goals`` /
    ``num_test_goals`` / ``catalogue_seed`` (official data, see ``catalogue.load_official``),
    ``results_per_page`` (10), ``max_results`` (50), ``admissible_chars``, ``page_text_chars``;
    ``catalogue`` passes a ready ``Catalogue`` instead (tests, custom shops).
    """

    max_turns: int = 12
    show_admissible: ClassVar[bool] = True
    slow_steps: ClassVar[bool] = True

    def __init__(self, data_dir: str | None = None, split: str = "train", max_turns: int = 12,
                 size: str = "small", num_products: int | None = 1000, human_goals: bool = True,
                 num_test_goals: int = NUM_TEST_GOALS, catalogue_seed: int = 0, results_per_page: int = 10,
                 max_results: int = 50, admissible_chars: int | None = 2000, page_text_chars: int = 1500,
                 catalogue: Catalogue | None = None) -> None:
        if int(max_turns) < 1:
            raise ValueError(f"max_turns must be positive, got {max_turns!r}")
        if int(results_per_page) < 1 or int(max_results) < 1:
            raise ValueError("results_per_page and max_results must be positive")
        self.catalogue = catalogue if catalogue is not None else load_catalogue(
            data_dir, size=size, num_products=num_products, human_goals=human_goals,
            num_test_goals=num_test_goals, seed=catalogue_seed,
        )
        self.split = split
        self._goal_ids = self.catalogue.goal_indices(split)
        self.max_turns = int(max_turns)
        self.results_per_page = int(results_per_page)
        self.max_results = int(max_results)
        self.admissible_chars = None if admissible_chars is None else int(admissible_chars)
        self.page_text_chars = int(page_text_chars)
        self.prompt_spec = webshop_prompt_spec(self.max_turns)
        self._seed: int | None = None
        self._goal_id: int | None = None
        self._page = _Page("search")

    # -- protocol -------------------------------------------------------------------------------
    def reset(self, seed: int, *, opponent: str | None = None, seat: int | None = None,
              copy: int = 0) -> str:
        if opponent is not None or seat not in (None, 0):
            raise ValueError(f"WebShop is a single-agent task; got opponent {opponent!r}, seat {seat!r}")
        self._seed = int(seed)
        self._goal_id = self._goal_ids[random.Random(self._seed).randrange(len(self._goal_ids))]
        return self.restart()

    def restart(self) -> str:
        self._require_goal()
        self._page = _Page("search")
        return self.observation

    def step_action(self, action: str) -> StepResult:
        self._require_goal()
        page = self._page
        if page.kind == "done":
            return self.invalid_step("the episode is over")
        match = _ACTION.fullmatch(action.strip())
        if match is None:
            return self.invalid_step("expected search[...] or click[...]")
        verb, arg = match.group(1).lower(), _SPACES.sub(" ", match.group(2).strip())
        if verb == "search":
            if page.kind != "search":
                return self.invalid_step("no search bar on this page; click[back to search] first")
            if not arg or len(arg) > MAX_QUERY_CHARS:
                return self.invalid_step(f"the query must have 1 to {MAX_QUERY_CHARS} characters")
            results = tuple(self.catalogue.index.search(arg, self.max_results))
            return self._move(_Page("results", query=arg, results=results), f"search[{arg}]")
        target = _key(arg)
        if target not in self._clickables(page):
            return self.invalid_step(f"{arg!r} is not clickable on this page")
        return self._click(page, target)

    def legal_actions(self) -> list[str]:
        """The admissible actions of the current page, fitted to ``admissible_chars``."""
        page = self._page
        if self._goal_id is None or page.kind == "done":
            return []
        if page.kind == "search":
            return [SEARCH_TEMPLATE]
        actions = [f"click[{c}]" for c in self._clickables(page)]
        return fit_admissible(actions, self.admissible_chars, self._rank)

    @property
    def observation(self) -> str:
        goal, page = self.goal, self._page
        head = ["Instruction:", goal.instruction]
        if page.kind == "search":
            return SEP.join(["WebShop", *head, "Search"])
        if page.kind == "results":
            return SEP.join(head + self._results_elements(page))
        if page.kind == "item":
            return SEP.join(head + self._item_elements(page))
        if page.kind == "detail":
            return SEP.join(head + ["Back to Search", "< Prev", self._detail_text(page)])
        return SEP.join(self._receipt_elements(page))

    @property
    def task_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"seed": self._seed, "split": self.split, "catalogue": self.catalogue.name}
        if self._goal_id is not None:
            goal = self.goal
            info.update(goal_index=self._goal_id, goal_asin=goal.asin, task_type=goal.category)
        return info

    # -- extras ---------------------------------------------------------------------------------
    def reset_to_goal(self, goal_index: int) -> str:
        """Play goal ``goal_index`` of the catalogue (tests, demos) instead of a seed's goal."""
        if not 0 <= int(goal_index) < len(self.catalogue.goals):
            raise ValueError(f"goal index {goal_index} out of range 0..{len(self.catalogue.goals) - 1}")
        self._seed, self._goal_id = None, int(goal_index)
        return self.restart()

    @property
    def goal(self) -> Goal:
        return self.catalogue.goals[self._require_goal()]

    @property
    def done(self) -> bool:
        return self._page.kind == "done"

    @property
    def page_kind(self) -> str:
        return self._page.kind

    @property
    def selected_options(self) -> dict[str, str]:
        return dict(self._page.selected)

    # -- pages ----------------------------------------------------------------------------------
    def _num_pages(self, page: _Page) -> int:
        return max(1, -(-len(page.results) // self.results_per_page))

    def _page_products(self, page: _Page) -> list[Product]:
        start = (page.page - 1) * self.results_per_page
        return [self.catalogue.products[i] for i in page.results[start : start + self.results_per_page]]

    def _clickables(self, page: _Page) -> list[str]:
        if page.kind == "results":
            out = [BACK]
            if page.page > 1:
                out.append(PREV)
            if page.page < self._num_pages(page):
                out.append(NEXT)
            return out + [p.asin.lower() for p in self._page_products(page)]
        if page.kind == "item":
            values = list(dict.fromkeys(_key(v) for _, vs in self._product(page).options for v in vs))
            nav = [BACK, PREV, *DETAILS, BUY]
            return [BACK, PREV, *[v for v in values if v not in nav], *DETAILS, BUY]
        if page.kind == "detail":
            return [BACK, PREV]
        return []

    @staticmethod
    def _rank(action: str) -> int:
        inner = action[len("click[") : -1]
        if inner == BUY:
            return 0
        if inner in (BACK, PREV, NEXT):
            return 2
        if inner in DETAILS:
            return 3
        return 1  # option values and products

    def _product(self, page: _Page) -> Product:
        assert page.item is not None
        return self.catalogue.products[page.item]

    def _results_elements(self, page: _Page) -> list[str]:
        out = ["Back to Search"]
        if page.page > 1:
            out.append("< Prev")
        out.append(f"Page {page.page} (Total results: {len(page.results)})")
        if page.page < self._num_pages(page):
            out.append("Next >")
        products = self._page_products(page)
        if not products:
            out.append("No products match your search.")
        for p in products:
            out += [p.asin, p.name, p.price_tag]
        return out

    def _item_elements(self, page: _Page) -> list[str]:
        product = self._product(page)
        out = ["Back to Search", "< Prev"]
        for name, values in product.options:
            out += [name, *values]
        if page.selected:
            out.append("Selected: " + ", ".join(f"{n}: {v}" for n, v in page.selected))
        out += [product.name, f"Price: {product.price_tag}", "Rating: N.A.", "Description", "Features",
                "Reviews", "Buy Now"]
        return out

    def _detail_text(self, page: _Page) -> str:
        product = self._product(page)
        if page.detail == "description":
            text = product.description or "No description."
        elif page.detail == "features":
            text = SEP.join(product.bullet_points) or "No features listed."
        else:
            text = "No reviews yet."
        if len(text) > self.page_text_chars:
            text = text[: self.page_text_chars].rstrip() + " ..."
        return text

    def _receipt_elements(self, page: _Page) -> list[str]:
        product, score = self._product(page), page.purchase
        assert score is not None
        chosen = ", ".join(f"{n}: {v}" for n, v in page.selected) or "none"
        return ["Thank you for shopping with us!", "Purchased", product.name, "Options", chosen,
                f"Price: ${product.price:.2f}", "Your score (min 0.0, max 1.0)", f"{score.score:.2f}"]

    # -- transitions ----------------------------------------------------------------------------
    def _move(self, page: _Page, action: str) -> StepResult:
        self._page = page
        return StepResult(self.observation, 0.0, False, StepInfo(valid=True), action=action)

    def _click(self, page: _Page, target: str) -> StepResult:
        action = f"click[{target}]"
        if target == BACK:
            return self._move(_Page("search"), action)
        if page.kind == "results":
            if target == NEXT:
                return self._move(dataclasses.replace(page, page=page.page + 1), action)
            if target == PREV:
                return self._move(dataclasses.replace(page, page=page.page - 1), action)
            item = self.catalogue.by_asin[target]
            return self._move(dataclasses.replace(page, kind="item", item=item, selected=()), action)
        if page.kind == "detail":  # only < prev is left
            return self._move(dataclasses.replace(page, kind="item", detail=None), action)
        # item page
        if target == PREV:
            return self._move(dataclasses.replace(page, kind="results", item=None, selected=()), action)
        if target in DETAILS:
            return self._move(dataclasses.replace(page, kind="detail", detail=target), action)
        if target == BUY:
            return self._buy(page)
        name = next(n for n, vs in self._product(page).options if target in (_key(v) for v in vs))
        value = next(v for v in dict(self._product(page).options)[name] if _key(v) == target)
        selected = dict(page.selected)
        selected[name] = value
        order = [n for n, _ in self._product(page).options if n in selected]
        return self._move(dataclasses.replace(page, selected=tuple((n, selected[n]) for n in order)), action)

    def _buy(self, page: _Page) -> StepResult:
        product, goal = self._product(page), self.goal
        score = purchase_score(
            product_name=product.name,
            product_query=product.query,
            product_category=product.product_category,
            product_attributes=product.attributes,
            product_text=product.text,
            chosen_options=[v for _, v in page.selected],
            price=product.price,
            goal_name=goal.name,
            goal_query=goal.query,
            goal_category=goal.product_category,
            goal_attributes=goal.attributes,
            goal_options=goal.options,
            price_upper=goal.price_upper,
        )
        self._page = dataclasses.replace(page, kind="done", purchase=score)
        return StepResult(
            observation=self.observation,
            reward=SUCCESS_REWARD if score.success else 0.0,
            done=True,
            info=StepInfo(
                won=score.success,
                valid=True,
                score=score.score,
                extra={"purchase": score.as_dict(), "asin": product.asin, "options": dict(page.selected)},
            ),
            action=f"click[{BUY}]",
        )

    def _require_goal(self) -> int:
        if self._goal_id is None:
            raise RuntimeError("call reset(seed) before using the WebShop environment")
        return self._goal_id
