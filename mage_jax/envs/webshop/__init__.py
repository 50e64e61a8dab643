"""WebShop (docs/method.md §7.6): a text shopping site of our own over the generated or official catalogue.

Modules: ``catalogue`` (products, goals, splits, the official-file loader), ``generate`` (the seeded
generator of the shipped catalogue), ``reward`` (the purchase score), ``search`` (BM25 ranking via
``bm25s``, imported on first search) and ``env`` (the pages and the ``TextEnv``).
"""

from mage_jax.envs.webshop.catalogue import Catalogue, Goal, Product, load_catalogue
from mage_jax.envs.webshop.env import HELD_OUT_SPLITS, SPLITS, WebShopEnv, webshop_prompt_spec
from mage_jax.envs.webshop.reward import PurchaseScore, purchase_score

__all__ = [
    "HELD_OUT_SPLITS",
    "SPLITS",
    "Catalogue",
    "Goal",
    "Product",
    "PurchaseScore",
    "WebShopEnv",
    "load_catalogue",
    "purchase_score",
    "webshop_prompt_spec",
]
