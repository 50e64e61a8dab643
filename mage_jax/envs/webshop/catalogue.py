"""Products, goals and their train / test split: the generated catalogue or the official WebShop files.

Two sources, one data model:

* **generated** (default) — a small seeded catalogue shipped as ``data/generated_catalogue.json``
  (``python -m mage_jax.envs.webshop.generate`` rewrites it identically); for tests and demos.
* **official** — the WebShop release files in a local folder (``data_dir``): ``items_shuffle_1000.json``
  and ``items_ins_v2_1000.json`` (the 1000-product "small" setting; ``size="full"`` reads
  ``items_shuffle.json`` / ``items_ins_v2.json``), plus ``items_human_ins.json`` for the human-written
  goals. Products are cleaned as the reference site does (duplicate / malformed ASINs dropped,
  option values lowercased with "/" shown as " | ", prices parsed from the "$a - $b" text), goals
  are derived as the reference does (one per human instruction, or one per option combination of
  the synthetic instructions), shuffled with seed 233, and the first 500 form the test split (the
  rest train). Where the reference draws at random without a seed (the price paid inside a price
  range, the goal's price limit) we draw with ``seed``, so a catalogue is reproducible.

Goal price limits follow the reference rule: of the price steps $10, $20, ..., $990 above the
product's price, take the first four and the larger of two drawn from them ("price lower than X
dollars"); with fewer than two steps the goal has no price limit.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import random
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mage_jax.envs.webshop.reward import goal_option_values

__all__ = [
    "Catalogue",
    "GENERATED_PATH",
    "Goal",
    "OFFICIAL_FILES",
    "PRICE_STEPS",
    "Product",
    "load_catalogue",
    "load_generated",
    "load_official",
    "price_limit",
]

GENERATED_PATH = Path(__file__).parent / "data" / "generated_catalogue.json"
OFFICIAL_FILES = {
    "small": ("items_shuffle_1000.json", "items_ins_v2_1000.json"),
    "full": ("items_shuffle.json", "items_ins_v2.json"),
}
HUMAN_GOALS_FILE = "items_human_ins.json"
PRICE_STEPS = tuple(10.0 * i for i in range(1, 100))
NO_PRICE_LIMIT = 1_000_000.0
GOAL_SHUFFLE_SEED = 233
NUM_TEST_GOALS = 500


@dataclasses.dataclass(frozen=True)
class Product:
    """One product page. ``price`` is what a purchase costs (drawn inside ``pricing`` for a range)."""

    asin: str
    name: str
    query: str
    category: str
    product_category: str
    pricing: tuple[float, ...]
    price: float
    options: tuple[tuple[str, tuple[str, ...]], ...]
    """(option name, its values) in page order."""
    attributes: tuple[str, ...]
    bullet_points: tuple[str, ...]
    description: str

    @property
    def price_tag(self) -> str:
        if len(self.pricing) >= 2:
            return f"${self.pricing[0]:.2f} to ${self.pricing[1]:.2f}"
        return f"${self.price:.2f}"

    @property
    def text(self) -> str:
        """Title, bullet points and description: where unlisted attributes are looked for."""
        return " ".join([self.name, *self.bullet_points, self.description])

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["options"] = {name: list(values) for name, values in self.options}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Product:
        return cls(
            asin=str(data["asin"]),
            name=str(data["name"]),
            query=str(data["query"]),
            category=str(data["category"]),
            product_category=str(data["product_category"]),
            pricing=tuple(float(p) for p in data["pricing"]),
            price=float(data["price"]),
            options=tuple((str(k), tuple(str(v) for v in vs)) for k, vs in dict(data["options"]).items()),
            attributes=tuple(str(a) for a in data["attributes"]),
            bullet_points=tuple(str(b) for b in data["bullet_points"]),
            description=str(data["description"]),
        )


@dataclasses.dataclass(frozen=True)
class Goal:
    """What the shopper wants: the instruction text and the terms the purchase score checks."""

    asin: str
    """The product the goal was derived from (one product that scores 1.0)."""
    instruction: str
    attributes: tuple[str, ...]
    options: tuple[str, ...]
    """Wanted option values (U_opt)."""
    price_upper: float
    query: str
    name: str
    category: str
    product_category: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Goal:
        return cls(
            asin=str(data["asin"]),
            instruction=str(data["instruction"]),
            attributes=tuple(str(a) for a in data["attributes"]),
            options=tuple(str(o) for o in data["options"]),
            price_upper=float(data["price_upper"]),
            query=str(data["query"]),
            name=str(data["name"]),
            category=str(data["category"]),
            product_category=str(data["product_category"]),
        )


class Catalogue:
    """Products, goals and named goal splits; builds its search index once, on first use."""

    def __init__(self, name: str, products: Sequence[Product], goals: Sequence[Goal],
                 splits: Mapping[str, Sequence[int]]) -> None:
        self.name = name
        self.products = tuple(products)
        self.goals = tuple(goals)
        self.splits = {k: tuple(int(i) for i in v) for k, v in splits.items()}
        self.splits.setdefault("all", tuple(range(len(self.goals))))
        self.by_asin = {p.asin.lower(): i for i, p in enumerate(self.products)}
        self._index = None

    def goal_indices(self, split: str) -> tuple[int, ...]:
        if split not in self.splits:
            known = ", ".join(sorted(self.splits))
            raise ValueError(f"unknown WebShop split {split!r}; this catalogue has: {known}")
        indices = self.splits[split]
        if not indices:
            raise ValueError(f"WebShop split {split!r} of catalogue {self.name!r} has no goals")
        return indices

    @property
    def index(self):
        """The BM25 index over the products (``mage_jax.envs.webshop.search``), built on first use."""
        if self._index is None:
            from mage_jax.envs.webshop.search import SearchIndex

            self._index = SearchIndex([search_text(p) for p in self.products])
        return self._index

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "products": [p.to_json() for p in self.products],
            "goals": [g.to_json() for g in self.goals],
            "splits": {k: list(v) for k, v in self.splits.items() if k != "all"},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Catalogue:
        return cls(
            str(data["name"]),
            [Product.from_json(p) for p in data["products"]],
            [Goal.from_json(g) for g in data["goals"]],
            data["splits"],
        )


def search_text(product: Product) -> str:
    """The document BM25 indexes: title, bullet points, description and option values."""
    values = [v for _, vs in product.options for v in vs]
    return " ".join([product.name, *product.bullet_points, product.description, *values])


def price_limit(price: float, rng: random.Random) -> tuple[float, str]:
    """(price_upper, instruction suffix) by the reference rule (module docstring)."""
    steps = [p for p in PRICE_STEPS if p > price][:4]
    if len(steps) < 2:
        return NO_PRICE_LIMIT, ""
    upper = max(rng.sample(steps, 2))
    return upper, f", and price lower than {upper:.2f} dollars"


# ------------------------------------------------------------------------------------------------
# Generated catalogue


def load_generated(path: str | os.PathLike | None = None) -> Catalogue:
    """The shipped generated catalogue (or another file written by ``generate``)."""
    path = Path(path) if path is not None else GENERATED_PATH
    return Catalogue.from_json(_read_json(path))


# ------------------------------------------------------------------------------------------------
# Official WebShop files


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def _missing_data_error(folder: Path, missing: Sequence[str]) -> FileNotFoundError:
    return FileNotFoundError(
        f"WebShop data not found: {', '.join(missing)} missing in {folder}. Put the official WebShop "
        "release files there (the WebShop repository's setup script downloads them into its data/ "
        "folder: items_shuffle_1000.json and items_ins_v2_1000.json for the 1000-product setting, "
        "items_human_ins.json for human goals), or leave data_dir unset to use the generated "
        "catalogue shipped with mage_jax."
    )


_PRICE = re.compile(r"[^\d.]")


def _parse_pricing(raw: Any) -> tuple[float, ...]:
    """'$12.99' -> (12.99,); '$10.00 - $20.00' -> (10.0, 20.0); missing or unparseable -> (100.0,)."""
    if isinstance(raw, (int, float)):
        return (float(raw),)
    if not raw or not isinstance(raw, str):
        return (100.0,)
    prices = []
    for piece in raw.split("$")[1:]:
        text = _PRICE.sub("", piece).strip(".")
        try:
            prices.append(float(text))
        except ValueError:
            continue
    return tuple(prices[:2]) if prices else (100.0,)


def _official_product(raw: Mapping[str, Any], info: Mapping[str, Any], rng: random.Random) -> Product:
    options = []
    for name, contents in dict(raw.get("customization_options") or {}).items():
        if not contents:
            continue
        values = []
        for entry in contents:
            value = entry.get("value") if isinstance(entry, Mapping) else entry
            if value is not None:
                values.append(str(value).strip().replace("/", " | ").lower())
        if values:
            options.append((str(name).lower(), tuple(values)))
    bullets = raw.get("small_description") or []
    bullets = [bullets] if isinstance(bullets, str) else list(bullets)
    pricing = _parse_pricing(raw.get("pricing"))
    price = pricing[0] if len(pricing) == 1 else round(rng.uniform(pricing[0], pricing[1]), 2)
    return Product(
        asin=str(raw["asin"]),
        name=str(raw.get("name") or ""),
        query=str(raw.get("query") or "").lower().strip(),
        category=str(raw.get("category") or ""),
        product_category=str(raw.get("product_category") or ""),
        pricing=pricing,
        price=float(price),
        options=tuple(options),
        attributes=tuple(str(a) for a in info.get("attributes") or ()),
        bullet_points=tuple(str(b) for b in bullets),
        description=str(raw.get("full_description") or ""),
    )


def _goal(product: Product, instruction: str, attributes: Sequence[str], options: Sequence[str],
          rng: random.Random) -> Goal:
    upper, suffix = price_limit(product.price, rng)
    return Goal(
        asin=product.asin,
        instruction=instruction + suffix,
        attributes=tuple(str(a) for a in attributes),
        options=tuple(options),
        price_upper=upper,
        query=product.query,
        name=product.name,
        category=product.category,
        product_category=product.product_category,
    )


def load_official(data_dir: str | os.PathLike, *, size: str = "small", num_products: int | None = 1000,
                  human_goals: bool = True, num_test_goals: int = NUM_TEST_GOALS, seed: int = 0) -> Catalogue:
    """Read the official WebShop files from ``data_dir`` (module docstring)."""
    folder = Path(data_dir).expanduser()
    if size not in OFFICIAL_FILES:
        raise ValueError(f"unknown WebShop data size {size!r}; known: {', '.join(OFFICIAL_FILES)}")
    needed = list(OFFICIAL_FILES[size]) + ([HUMAN_GOALS_FILE] if human_goals else [])
    missing = [n for n in needed if not (folder / n).is_file()]
    if missing:
        raise _missing_data_error(folder, missing)
    products_file, attributes_file = OFFICIAL_FILES[size]
    raw_products = _read_json(folder / products_file)
    infos = _read_json(folder / attributes_file)
    human = _read_json(folder / HUMAN_GOALS_FILE) if human_goals else {}
    if not isinstance(raw_products, list) or not isinstance(infos, Mapping) or not isinstance(human, Mapping):
        raise ValueError(f"unexpected layout of the WebShop files in {folder}: expected a product list and "
                         "ASIN-keyed attribute / instruction objects")
    if num_products is not None:
        raw_products = raw_products[: int(num_products)]

    rng = random.Random(seed)
    products: list[Product] = []
    seen: set[str] = set()
    for raw in raw_products:
        asin = str(raw.get("asin", "nan")) if isinstance(raw, Mapping) else "nan"
        if asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        products.append(_official_product(raw, infos.get(asin) or {}, rng))

    goals: list[Goal] = []
    for product in products:
        if human_goals:
            for entry in human.get(product.asin) or ():
                attributes = entry.get("instruction_attributes") or []
                if not attributes:
                    continue
                text = str(entry.get("instruction", "")).strip(".")
                goals.append(_goal(product, text, attributes,
                                   goal_option_values(entry.get("instruction_options")), rng))
        else:
            info = infos.get(product.asin) or {}
            text, attributes = info.get("instruction"), info.get("instruction_attributes") or []
            if not text or not attributes:
                continue
            names = sorted(name for name, _ in product.options)
            values = dict(product.options)
            for combination in itertools.product(*(values[n] for n in names)):
                chosen = ", and ".join(f"{n}: {v}" for n, v in zip(names, combination))
                goals.append(_goal(product, str(text) + (f" with {chosen}" if chosen else ""),
                                   attributes, combination, rng))
    order = list(range(len(goals)))
    random.Random(GOAL_SHUFFLE_SEED).shuffle(order)
    goals = [goals[i] for i in order]
    cut = min(int(num_test_goals), len(goals))
    splits = {"test": range(cut), "train": range(cut, len(goals))}
    return Catalogue(f"official-{size}", products, goals, splits)


# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _cached(data_dir: str | None, size: str, num_products: int | None, human_goals: bool,
            num_test_goals: int, seed: int) -> Catalogue:
    if data_dir is None:
        return load_generated()
    return load_official(data_dir, size=size, num_products=num_products, human_goals=human_goals,
                         num_test_goals=num_test_goals, seed=seed)


def load_catalogue(data_dir: str | os.PathLike | None = None, *, size: str = "small",
                   num_products: int | None = 1000, human_goals: bool = True,
                   num_test_goals: int = NUM_TEST_GOALS, seed: int = 0) -> Catalogue:
    """The generated catalogue (``data_dir=None``) or the official files; cached per process, so the
    environments of one run share one catalogue and one search index."""
    key = None if data_dir is None else str(Path(data_dir).expanduser().resolve())
    return _cached(key, size, None if num_products is None else int(num_products), bool(human_goals),
                   int(num_test_goals), int(seed))
