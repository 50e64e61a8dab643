"""WebShop: the purchase score, the catalogues, BM25 search and the pages of the text site."""

from __future__ import annotations

import json
import sys

import pytest

from mage_jax.envs.admissible import fit_admissible, listed_chars
from mage_jax.envs.base import make_env
from mage_jax.envs.prompts import Move, render_play_prompt
from mage_jax.envs.webshop.catalogue import (
    GENERATED_PATH,
    Catalogue,
    Goal,
    Product,
    load_generated,
    load_official,
    price_limit,
)
from mage_jax.envs.webshop.env import WebShopEnv
from mage_jax.envs.webshop.generate import catalogue_json, generate_catalogue
from mage_jax.envs.webshop.reward import purchase_score, token_match, type_factor
from mage_jax.envs.webshop.search import SearchIndex, require_bm25s
from tests.optional import require

require("bm25s")


# ------------------------------------------------------------------------------------------------
# A hand-made shop: twelve running shoes (two result pages for "running shoes") and a shampoo.


def _product(asin: str, name: str, *, query: str = "running shoes", price: float = 50.0,
             attributes=("non slip",), options=(("size", ("9", "10")), ("color", ("black", "white"))),
             path="clothing › men › shoes › running shoes", description="A shoe.") -> Product:
    return Product(
        asin=asin, name=name, query=query, category="fashion", product_category=path, pricing=(price,),
        price=price, options=tuple(options), attributes=tuple(attributes),
        bullet_points=(f"{attributes[0].upper()}: great",) if attributes else (), description=description,
    )


SHAMPOO = _product(
    "B0SHAMPOO1", "Velora Sulfate Free Shampoo", query="shampoo", price=12.0,
    attributes=("sulfate free", "natural ingredients"),
    options=(("scent", ("lavender", "coconut")), ("size", ("8 fl oz", "16 fl oz"))),
    path="beauty & personal care › hair care › shampoo", description="Gentle and paraben free formula.",
)
SHOES = [_product(f"B0SHOE{i:04d}", f"Brand{i} Running Shoes", price=40.0 + i) for i in range(12)]


def _goal(product: Product, attributes, options, price_upper=100.0) -> Goal:
    return Goal(asin=product.asin, instruction=f"i want {product.query}", attributes=tuple(attributes),
                options=tuple(options), price_upper=price_upper, query=product.query, name=product.name,
                category=product.category, product_category=product.product_category)


GOALS = [
    _goal(SHAMPOO, ["sulfate free"], ["lavender", "16 fl oz"], 20.0),
    _goal(SHOES[3], ["non slip"], ["10", "black"], 50.0),
]


@pytest.fixture
def shop() -> WebShopEnv:
    catalogue = Catalogue("hand", [SHAMPOO, *SHOES], GOALS, {"train": [0, 1], "test": [1]})
    env = WebShopEnv(catalogue=catalogue)
    env.reset_to_goal(0)
    return env


def _act(env: WebShopEnv, action: str):
    return env.step(f"<think>let me see</think><action>{action}</action>")


# ------------------------------------------------------------------------------------------------
# Purchase score


def _score(product: Product, goal: Goal, chosen, price=None):
    return purchase_score(
        product_name=product.name, product_query=product.query, product_category=product.product_category,
        product_attributes=product.attributes, product_text=product.text, chosen_options=chosen,
        price=product.price if price is None else price, goal_name=goal.name, goal_query=goal.query,
        goal_category=goal.product_category, goal_attributes=goal.attributes, goal_options=goal.options,
        price_upper=goal.price_upper,
    )


def test_buying_the_goal_product_with_the_goal_options_scores_one():
    score = _score(SHAMPOO, GOALS[0], ["lavender", "16 fl oz"])
    assert score.score == 1.0 and score.success


def test_hand_worked_partial_purchase():
    # Wanted: sulfate free (a listed attribute), paraben free (only in the description), for dry hair
    # (nowhere); options lavender (chosen) and 16 fl oz (8 fl oz chosen); price 12 <= 20.
    goal = _goal(SHAMPOO, ["sulfate free", "paraben free", "for dry hair"], ["lavender", "16 fl oz"], 20.0)
    score = _score(SHAMPOO, goal, ["lavender", "8 fl oz"])
    assert (score.attribute_matches, score.option_matches, score.price_ok) == (2, 1, True)
    assert score.r_type == 1.0
    assert score.score == pytest.approx((2 + 1 + 1) / (3 + 2 + 1))
    assert not score.success


def test_price_over_the_limit_loses_the_price_term():
    goal = _goal(SHAMPOO, ["sulfate free"], ["lavender"], 10.0)
    score = _score(SHAMPOO, goal, ["lavender"])
    assert not score.price_ok and score.score == pytest.approx(2 / 3)


def test_unselected_options_never_match():
    assert _score(SHAMPOO, GOALS[0], []).score == pytest.approx((1 + 0 + 1) / 4)


def test_wrong_product_type_scales_the_score_down():
    # A shoe bought for the shampoo goal: no query / category match and no shared type word -> 0.
    score = _score(SHOES[0], GOALS[0], ["10"])
    signals = (score.query_match, score.category_match, score.title_score, score.r_type)
    assert signals == (False, False, 0.0, 0.0)
    assert score.score == 0.0


def test_type_factor_rules():
    assert type_factor(True, False, 1.0) == 1.0
    assert type_factor(False, True, 0.5) == 1.0
    assert type_factor(False, False, 0.5) == 1.0  # title score above 0.2 alone is enough
    assert type_factor(False, False, 0.2) == 0.5
    assert type_factor(True, True, 0.05) == 0.1
    assert type_factor(True, True, 0.0) == 0.0


def test_category_match_needs_two_shared_levels():
    path = "beauty & personal care › hair care"
    other = _product("B0OTHER001", "Zed Shampoo", query="hair wash", path=path)
    score = _score(other, GOALS[0], ["lavender", "16 fl oz"], price=12.0)
    assert score.category_match and not score.query_match
    # Goal name "Velora Sulfate Free Shampoo": type words velora, sulfate, free, shampoo; one shared.
    assert score.title_score == pytest.approx(0.25)


def test_token_match_is_containment_of_token_sets():
    assert token_match("lavender", "Lavender Scent")
    assert token_match("x-large", "large")  # as the reference's token-set ratio
    assert not token_match("red", "dark blue")
    assert not token_match("", "red")


def test_every_generated_goal_is_achieved_by_its_source_product():
    catalogue = load_generated()
    products = {p.asin: p for p in catalogue.products}
    for goal in catalogue.goals:
        assert _score(products[goal.asin], goal, goal.options).success, goal


def test_price_limit_follows_the_reference_rule():
    import random

    upper, text = price_limit(12.0, random.Random(0))
    assert upper in (30.0, 40.0, 50.0) and text == f", and price lower than {upper:.2f} dollars"
    assert price_limit(985.0, random.Random(0))[1] == ""  # fewer than two price steps above


# ------------------------------------------------------------------------------------------------
# Catalogues


def test_shipped_catalogue_is_the_seeded_generation():
    assert GENERATED_PATH.read_text(encoding="utf-8") == catalogue_json(generate_catalogue(0))
    catalogue = load_generated()
    assert len(catalogue.products) == 100 and len({p.category for p in catalogue.products}) >= 5
    assert set(catalogue.splits["train"]).isdisjoint(catalogue.splits["test"])
    assert len(catalogue.splits["train"]) + len(catalogue.splits["test"]) == len(catalogue.goals)


def _write_official(folder, human=True):
    products = [
        {"asin": "B000000001", "name": "Aqua Running Shoes", "query": "Running Shoes ", "category": "fashion",
         "product_category": "clothing › shoes", "full_description": "Light.", "small_description": "Grip",
         "pricing": "$20.00 - $30.00",
         "customization_options": {"Color": [{"value": "Black/White"}, {"value": "Red"}],
                                   "Size": [{"value": "9"}, {"value": "10"}]}},
        {"asin": "B000000001", "name": "duplicate", "query": "x"},
        {"asin": "nan", "name": "no asin"},
        {"asin": "B000000002", "name": "Plain Mug", "query": "mug", "category": "home",
         "product_category": "home › kitchen", "pricing": "$5.50", "customization_options": None},
    ]
    infos = {
        "B000000001": {"attributes": ["non slip"], "instruction": "i need running shoes",
                       "instruction_attributes": ["non slip"]},
        "B000000002": {"attributes": ["dishwasher safe"], "instruction": "i need a mug",
                       "instruction_attributes": ["dishwasher safe"]},
    }
    human_goals = {
        "B000000001": [
            {"instruction": "i want non slip shoes.", "instruction_attributes": ["non slip"],
             "instruction_options": ["black | white"]},
            {"instruction": "no attributes: skipped", "instruction_attributes": [],
             "instruction_options": []},
        ],
        "B000000002": [{"instruction": "a mug", "instruction_attributes": ["dishwasher safe"],
                        "instruction_options": {}}],
    }
    (folder / "items_shuffle_1000.json").write_text(json.dumps(products))
    (folder / "items_ins_v2_1000.json").write_text(json.dumps(infos))
    if human:
        (folder / "items_human_ins.json").write_text(json.dumps(human_goals))


def test_official_files_are_cleaned_as_the_reference_site_does(tmp_path):
    _write_official(tmp_path)
    catalogue = load_official(tmp_path, num_test_goals=1)
    assert [p.asin for p in catalogue.products] == ["B000000001", "B000000002"]
    shoes, mug = catalogue.products
    assert shoes.query == "running shoes"
    assert shoes.options == (("color", ("black | white", "red")), ("size", ("9", "10")))
    assert shoes.pricing == (20.0, 30.0) and 20.0 <= shoes.price <= 30.0
    assert shoes.price_tag == "$20.00 to $30.00"
    assert mug.price == 5.5 and mug.options == () and mug.attributes == ("dishwasher safe",)
    assert shoes.bullet_points == ("Grip",)
    # Human goals: the goal without attributes is skipped; the split is a deterministic shuffle.
    assert len(catalogue.goals) == 2
    assert len(catalogue.splits["test"]) == 1 and len(catalogue.splits["train"]) == 1
    shoe_goal = next(g for g in catalogue.goals if g.asin == "B000000001")
    assert shoe_goal.instruction.startswith("i want non slip shoes, and price lower than")
    assert shoe_goal.options == ("black | white",)
    assert load_official(tmp_path, num_test_goals=1).goals == catalogue.goals


def test_official_synthetic_goals_cover_every_option_combination(tmp_path):
    _write_official(tmp_path, human=False)
    catalogue = load_official(tmp_path, human_goals=False, num_test_goals=0)
    shoe_goals = [g for g in catalogue.goals if g.asin == "B000000001"]
    assert len(shoe_goals) == 4  # 2 colours x 2 sizes
    assert {g.options for g in shoe_goals} == {(c, s) for c in ("black | white", "red") for s in ("9", "10")}
    assert any("with color: red, and size: 10" in g.instruction for g in shoe_goals)


def test_missing_official_files_name_what_to_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="items_shuffle_1000.json.*items_human_ins.json"):
        load_official(tmp_path)
    with pytest.raises(FileNotFoundError, match="generated catalogue"):
        WebShopEnv(data_dir=str(tmp_path))


def test_an_empty_split_is_a_clear_error(tmp_path):
    _write_official(tmp_path)
    with pytest.raises(ValueError, match="split 'train'.*no goals"):
        WebShopEnv(catalogue=load_official(tmp_path, num_test_goals=500), split="train")
    with pytest.raises(ValueError, match="unknown WebShop split"):
        WebShopEnv(split="dev")


def test_missing_bm25s_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "bm25s", None)
    with pytest.raises(ImportError, match=r"pip install 'mage-jax\[webshop\]'"):
        require_bm25s()


# ------------------------------------------------------------------------------------------------
# Search


def test_bm25_ranks_by_query_terms_and_drops_unrelated_documents():
    index = SearchIndex(["red running shoes", "blue running shoes for trail running", "lavender shampoo"])
    assert index.search("trail running") == [1, 0]
    assert index.search("lavender") == [2]
    assert index.search("zzz qqq") == [] and index.search("the of") == []


def test_search_shows_ten_results_per_page_of_the_best_fifty(shop):
    result = _act(shop, "search[running shoes]")
    assert result.info.valid and result.action == "search[running shoes]"
    assert shop.page_kind == "results"
    assert "Page 1 (Total results: 12)" in result.observation
    listed = [a for a in shop.legal_actions() if a.startswith("click[b0shoe")]
    assert len(listed) == 10
    assert "click[next >]" in shop.legal_actions() and "click[< prev]" not in shop.legal_actions()


# ------------------------------------------------------------------------------------------------
# Pages


def test_search_click_select_options_and_buy(shop):
    initial = shop.observation
    assert initial.startswith("WebShop [SEP] Instruction: [SEP] i want shampoo")
    assert shop.legal_actions() == ["search[<your query>]"]
    _act(shop, "search[sulfate free shampoo]")
    assert shop.legal_actions() == ["click[back to search]", "click[b0shampoo1]"]
    item = _act(shop, "click[B0SHAMPOO1]")  # case-insensitive
    assert item.info.valid and shop.page_kind == "item"
    assert "scent [SEP] lavender [SEP] coconut" in item.observation and "Price: $12.00" in item.observation
    _act(shop, "click[coconut]")
    _act(shop, "click[lavender]")  # replaces the earlier scent
    _act(shop, "click[16 fl oz]")
    assert shop.selected_options == {"scent": "lavender", "size": "16 fl oz"}
    assert "Selected: scent: lavender, size: 16 fl oz" in shop.observation
    bought = _act(shop, "click[buy now]")
    assert bought.done and bought.info.won and bought.reward == 10.0 and bought.info.score == 1.0
    assert bought.info.extra["purchase"]["success"] and "Your score" in bought.observation
    assert shop.legal_actions() == []
    assert not _act(shop, "click[buy now]").info.valid


def test_imperfect_purchase_scores_but_earns_nothing(shop):
    _act(shop, "search[shampoo]")
    _act(shop, "click[b0shampoo1]")
    _act(shop, "click[lavender]")
    bought = _act(shop, "click[buy now]")
    assert bought.done and not bought.info.won and bought.reward == 0.0
    assert bought.info.score == pytest.approx(3 / 4)


def test_next_prev_back_and_detail_pages(shop):
    _act(shop, "search[running shoes]")
    page1 = shop.observation
    page2 = _act(shop, "click[next >]").observation
    assert "Page 2 (Total results: 12)" in page2 and "< Prev" in page2
    assert "click[next >]" not in shop.legal_actions()
    assert not _act(shop, "click[next >]").info.valid
    assert _act(shop, "click[< prev]").observation == page1
    _act(shop, "click[b0shoe0003]")
    _act(shop, "click[10]")
    features = _act(shop, "click[features]")
    assert "NON SLIP: great" in features.observation and shop.legal_actions() == ["click[back to search]",
                                                                                 "click[< prev]"]
    back = _act(shop, "click[< prev]")
    assert shop.page_kind == "item" and shop.selected_options == {"size": "10"}
    assert "Selected: size: 10" in back.observation
    assert _act(shop, "click[< prev]").observation == page1
    assert _act(shop, "click[back to search]").observation == shop.restart()


@pytest.mark.parametrize("action", [
    "buy now", "click buy now", "click[]", "click[nonexistent]", "search[shoes]", "click[back to search",
    "search[]", "CLICK[description ] extra", "\u00e9\u4e2d" * 50, "click[" + "x" * 5000 + "]",
])
def test_bad_actions_are_invalid_and_change_nothing(shop, action):
    _act(shop, "search[shampoo]")
    _act(shop, "click[b0shampoo1]")
    before = (shop.observation, shop.legal_actions(), shop.selected_options)
    result = _act(shop, action)
    assert not result.info.valid and result.reward == 0.0 and not result.done and result.action is None
    assert (shop.observation, shop.legal_actions(), shop.selected_options) == before


def test_search_only_on_the_search_page_and_missing_tags_are_invalid(shop):
    assert not shop.step("search[shampoo]").info.valid  # no <action> tags
    assert not _act(shop, "click[b0shampoo1]").info.valid  # nothing to click on the search page
    assert not _act(shop, "search[" + "a" * 301 + "]").info.valid


def test_restart_restores_the_same_goal_after_a_failed_purchase(shop):
    initial, goal = shop.observation, shop.goal
    _act(shop, "search[running shoes]")
    _act(shop, "click[b0shoe0001]")
    assert _act(shop, "click[buy now]").done
    assert shop.restart() == initial and shop.goal == goal
    assert shop.page_kind == "search" and shop.selected_options == {}


def test_seeds_pick_goals_of_the_split_deterministically():
    env = make_env("webshop", split="test")
    test_goals = set(env.catalogue.splits["test"])
    picked = set()
    for seed in range(60):
        first = env.reset(seed)
        assert env.task_info["goal_index"] in test_goals
        picked.add(env.task_info["goal_index"])
        assert env.reset(seed) == first
    assert len(picked) > 10
    assert env.task_info["task_type"] == env.goal.category


def test_generated_goal_can_be_found_and_bought_through_the_site():
    env = make_env("webshop")
    env.reset(7)
    goal = env.goal
    result = _act(env, f"search[{goal.query} {' '.join(goal.attributes)}]")
    assert f"click[{goal.asin.lower()}]" in env.legal_actions(), result.observation
    _act(env, f"click[{goal.asin}]")
    for value in goal.options:
        assert _act(env, f"click[{value}]").info.valid
    assert _act(env, "click[buy now]").info.won


# ------------------------------------------------------------------------------------------------
# Prompt budget


def test_fit_admissible_keeps_ranked_actions_in_their_original_order():
    actions = ["examine a", "go to b", "take c", "go to d", "look"]
    rank = {"take c": 0, "go to b": 1, "go to d": 1}.get
    assert fit_admissible(actions, None) == actions
    assert fit_admissible(actions, 1000) == actions
    kept = fit_admissible(actions, len("go to b, take c"), lambda a: rank(a, 2))
    assert kept == ["go to b", "take c"] and listed_chars(kept) <= len("go to b, take c")
    assert fit_admissible(actions, 1, lambda a: rank(a, 2)) == ["take c"]  # never empty


def test_item_page_admissible_list_is_fitted_and_keeps_buy_now():
    sizes = tuple(f"size {i} extra wide" for i in range(60))
    product = _product("B0WIDE0001", "Wide Running Shoes", options=(("size", sizes),))
    env = WebShopEnv(catalogue=Catalogue("wide", [product], [_goal(product, ["non slip"], [])], {}),
                     split="all", admissible_chars=300)
    env.reset(0)
    _act(env, "search[running shoes]")
    _act(env, "click[b0wide0001]")
    listed = env.legal_actions()
    assert "click[buy now]" in listed and listed_chars(listed) <= 300 and len(listed) < 60
    assert _act(env, f"click[{sizes[-1]}]").info.valid  # unlisted options still work


def test_longest_play_prompt_fits_the_paper_prompt_length():
    env = make_env("webshop")
    env.reset(3)
    moves = []
    script = ["search[shoes]", "click[next >]", "click[next >]", "click[< prev]", "click[back to search]",
              "search[dog food grain free]"]
    for action in script * 2:
        r = _act(env, action)
        moves.append(Move(r.action, r.observation, r.reward, r.info.valid))
    prompt = render_play_prompt(env.prompt_spec, env.restart(), [], 0, moves, admissible=env.legal_actions())
    assert env.prompt_spec.history_window == 5
    assert len(prompt) < 8192 * 2  # far below 8192 tokens even at two characters a token


def test_compact_prompt_renders_the_page_and_its_actions(shop):
    _act(shop, "search[shampoo]")
    prompt = render_play_prompt(shop.prompt_spec, shop.restart(), [], 0, [], admissible=shop.legal_actions(),
                                style="compact")
    assert prompt.startswith("webshop . buy the product") and "admissible : search [" in prompt
