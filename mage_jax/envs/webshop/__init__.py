"""WebShop (docs/method.md §7.6): a text shopping site of our own over the generated or official catalogue.

Modules: ``catalogue`` (products, goals, splits, the official-file loader), ``generate`` (the seeded
generator of the shipped catalogue), ``reward`` (the purchase score), ``search`` (BM25 ranking via
``bm25s``, imported on first search) and ``env`` (the pages and the ``TextEnv``).
"""
