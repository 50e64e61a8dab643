"""The seeded generator of the small WebShop catalogue shipped for tests and demos.

``python -m mage_jax.envs.webshop.generate`` rewrites ``data/generated_catalogue.json``; the same
seed always gives the same file (a test checks the shipped file against a fresh generation).

Products are drawn from eight departments, each with three product types, an attribute pool and
option pools (sizes, colours, flavours, ...). A product gets a made-up brand, two to four
attributes, some of its department's options (two or more values each) and a price (one in five a
price range). Goals are derived from products the way WebShop's synthetic goals are: some of the
product's attributes, one value of each of its options and a price limit above its price (the
reference rule in ``catalogue.price_limit``), so the source product always scores 1.0. Goals are
shuffled and split into train / test (20%).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import string
from pathlib import Path

from mage_jax.envs.webshop.catalogue import GENERATED_PATH, Catalogue, Goal, Product, price_limit

__all__ = ["DEPARTMENTS", "generate_catalogue", "main"]


@dataclasses.dataclass(frozen=True)
class Department:
    category: str
    path: str
    types: tuple[str, ...]
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    price_range: tuple[float, float]


DEPARTMENTS = (
    Department(
        "beauty", "beauty & personal care › hair care › shampoo & conditioner",
        ("shampoo", "conditioner", "hair oil"),
        ("sulfate free", "paraben free", "natural ingredients", "for dry hair", "cruelty free",
         "long lasting", "hair growth"),
        (("size", ("8 fl oz", "12 fl oz", "16 fl oz", "32 fl oz")),
         ("scent", ("lavender", "coconut", "unscented", "citrus"))),
        (6.0, 40.0),
    ),
    Department(
        "fashion", "clothing, shoes & jewelry › men › shoes",
        ("running shoes", "hiking boots", "slip on loafers"),
        ("non slip", "lightweight", "breathable", "rubber sole", "memory foam", "water resistant"),
        (("size", ("7", "8", "9", "10", "11", "12")),
         ("color", ("black", "white", "navy blue", "grey", "brown"))),
        (25.0, 120.0),
    ),
    Department(
        "electronics", "electronics › headphones, earbuds & accessories › headphones",
        ("wireless earbuds", "over ear headphones", "gaming headset"),
        ("noise cancelling", "water resistant", "long battery life", "fast charging", "hands free",
         "high fidelity"),
        (("color", ("black", "white", "rose gold", "midnight blue")),),
        (15.0, 150.0),
    ),
    Department(
        "grocery", "grocery & gourmet food › beverages › coffee, tea & cocoa",
        ("ground coffee", "green tea", "hot cocoa mix"),
        ("gluten free", "organic", "fair trade", "low sugar", "non gmo", "caffeine free"),
        (("size", ("12 ounce", "2 pound", "pack of 2", "pack of 6")),
         ("flavor name", ("original", "vanilla", "hazelnut", "caramel"))),
        (5.0, 45.0),
    ),
    Department(
        "home", "home & kitchen › bedding › sheets & pillowcases",
        ("bed pillows", "duvet cover", "sheet set"),
        ("machine washable", "hypoallergenic", "cooling", "easy clean", "soft microfiber", "wrinkle free"),
        (("size", ("twin", "full", "queen", "king")),
         ("color", ("white", "grey", "beige", "sage green"))),
        (18.0, 90.0),
    ),
    Department(
        "fashion", "clothing, shoes & jewelry › women › clothing",
        ("summer dress", "yoga pants", "cardigan sweater"),
        ("machine wash", "short sleeve", "high waist", "relaxed fit", "button closure", "soft fabric"),
        (("size", ("small", "medium", "large", "x-large")),
         ("color", ("red", "black", "floral print", "navy"))),
        (12.0, 70.0),
    ),
    Department(
        "tools", "tools & home improvement › lighting & ceiling fans › light bulbs",
        ("led light bulbs", "desk lamp", "string lights"),
        ("energy saving", "dimmable", "easy install", "remote control", "long lasting", "warm white"),
        (("size", ("4 pack", "8 pack", "12 pack")),
         ("color temperature", ("2700k", "4000k", "5000k"))),
        (8.0, 60.0),
    ),
    Department(
        "pets", "pet supplies › dogs › food, treats & grooming",
        ("dry dog food", "dog shampoo", "chew toys"),
        ("grain free", "high protein", "natural ingredients", "for small dogs", "durable", "vet approved"),
        (("size", ("5 pound", "15 pound", "30 pound")),
         ("flavor name", ("chicken", "beef", "salmon"))),
        (7.0, 65.0),
    ),
)

BRANDS = (
    "Velora", "Northway", "Lumora", "Brisa", "Kestrel", "Oakmere", "Tavi", "Corvel", "Sunlit", "Marlow",
    "Pinecrest", "Aurevo", "Holloway", "Zephra", "Quillon", "Ravenna", "Solace", "Tidewell",
)

_PHRASES = (
    "{a} design for everyday use.",
    "Made to be {a}, tested for quality.",
    "Enjoy a {a} experience every day.",
    "{a} and built to last.",
)

_TEMPLATES = (
    "i am looking for {article} {type} that is {attrs}",
    "i need {attrs} {type}",
    "find me {article} {type}, {attrs}",
    "i want to buy {attrs} {type}",
)


def _asin(rng: random.Random, taken: set[str]) -> str:
    while True:
        asin = "B0" + "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _price(rng: random.Random, low: float, high: float) -> float:
    return float(int(rng.uniform(low, high))) + 0.99


def _product(rng: random.Random, dept: Department, taken: set[str]) -> Product:
    kind = rng.choice(dept.types)
    brand = rng.choice(BRANDS)
    attributes = tuple(rng.sample(dept.attributes, rng.randint(2, 4)))
    options = []
    for name, pool in dept.options:
        if rng.random() < 0.8:
            count = rng.randint(2, len(pool))
            chosen = set(rng.sample(pool, count))
            options.append((name, tuple(v for v in pool if v in chosen)))
    low = _price(rng, *dept.price_range)
    if rng.random() < 0.2:
        pricing = (low, round(low + rng.randint(3, 15), 2))
        price = round(rng.uniform(*pricing), 2)
    else:
        pricing, price = (low,), low
    title_attrs = " ".join(a.title() for a in attributes[:1])
    extra = ", ".join(a.title() for a in attributes[1:3])
    name = f"{brand} {title_attrs} {kind.title()}" + (f", {extra}" if extra else "")
    bullets = tuple(f"{a.upper()}: " + rng.choice(_PHRASES).format(a=a.capitalize()) for a in attributes)
    description = (
        f"The {brand} {kind} is {' and '.join(attributes)}. "
        f"A favourite in {dept.path.split(' › ')[-1]}, backed by our satisfaction guarantee."
    )
    return Product(
        asin=_asin(rng, taken),
        name=name,
        query=kind,
        category=dept.category,
        product_category=dept.path,
        pricing=pricing,
        price=price,
        options=tuple(options),
        attributes=attributes,
        bullet_points=bullets,
        description=description,
    )


def _goal(rng: random.Random, product: Product) -> Goal:
    attributes = tuple(rng.sample(product.attributes, rng.randint(1, min(2, len(product.attributes)))))
    chosen = [(name, rng.choice(values)) for name, values in product.options]
    kind = product.query
    text = rng.choice(_TEMPLATES).format(
        article="an" if kind[0] in "aeiou" else "a", type=kind, attrs=" and ".join(attributes)
    )
    if chosen:
        text += " with " + ", and ".join(f"{n}: {v}" for n, v in chosen)
    upper, suffix = price_limit(product.price, rng)
    return Goal(
        asin=product.asin,
        instruction=text + suffix,
        attributes=attributes,
        options=tuple(v for _, v in chosen),
        price_upper=upper,
        query=product.query,
        name=product.name,
        category=product.category,
        product_category=product.product_category,
    )


def generate_catalogue(seed: int = 0, num_products: int = 100, goals_per_product: int = 2,
                       test_fraction: float = 0.2) -> Catalogue:
    """A catalogue of ``num_products`` products (departments in turn) and their goals (module docstring)."""
    rng = random.Random(seed)
    taken: set[str] = set()
    products = [_product(rng, DEPARTMENTS[i % len(DEPARTMENTS)], taken) for i in range(num_products)]
    goals: list[Goal] = []
    seen: set[str] = set()
    for product in products:
        for _ in range(goals_per_product):
            goal = _goal(rng, product)
            if goal.instruction not in seen:
                seen.add(goal.instruction)
                goals.append(goal)
    rng.shuffle(goals)
    cut = int(round(len(goals) * test_fraction))
    splits = {"test": range(cut), "train": range(cut, len(goals))}
    return Catalogue(f"generated-{seed}", products, goals, splits)


def catalogue_json(catalogue: Catalogue) -> str:
    return json.dumps(catalogue.to_json(), indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-products", type=int, default=100)
    parser.add_argument("--goals-per-product", type=int, default=2)
    parser.add_argument("--out", type=Path, default=GENERATED_PATH)
    args = parser.parse_args(argv)
    catalogue = generate_catalogue(args.seed, args.num_products, args.goals_per_product)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(catalogue_json(catalogue), encoding="utf-8")
    print(f"wrote {len(catalogue.products)} products and {len(catalogue.goals)} goals to {args.out}")


if __name__ == "__main__":
    main()
