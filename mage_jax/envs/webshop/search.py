"""BM25 product search (the ranking of WebShop's search results) over ``bm25s``.

The reference site ranks with Lucene BM25 (k1 = 0.9, b = 0.4); we use the same variant and
parameters through the maintained ``bm25s`` library (extra ``webshop``): lowercase word tokens,
English stop words removed, no stemming. Ties keep catalogue order, and products that share no
word with the query are not results, so the ranking is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["SearchIndex", "require_bm25s"]

K1, B = 0.9, 0.4


def require_bm25s():
    """Import ``bm25s`` or fail with the one line that fixes it."""
    try:
        import bm25s
    except ImportError:
        raise ImportError(
            "WebShop search needs the bm25s package: pip install 'mage-jax[webshop]' (or pip install bm25s)"
        ) from None
    return bm25s


class SearchIndex:
    """BM25 over a fixed list of documents; ``search`` returns document indices, best first."""

    def __init__(self, documents: Sequence[str]) -> None:
        bm25s = require_bm25s()
        self._bm25s = bm25s
        self.num_documents = len(documents)
        tokens = self._tokenize(list(documents))
        self._retriever = bm25s.BM25(k1=K1, b=B, method="lucene")
        self._retriever.index(tokens, show_progress=False)

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for ``query`` (zeros when no query word is indexed)."""
        words = self._tokenize([str(query)])[0]
        if not words or self.num_documents == 0:
            return np.zeros(self.num_documents, dtype=np.float32)
        return np.asarray(self._retriever.get_scores(words), dtype=np.float32)

    def search(self, query: str, k: int = 50) -> list[int]:
        """Indices of the ``k`` best documents with a positive score, best first, ties in index order."""
        scores = self.scores(query)
        order = np.argsort(-scores, kind="stable")
        return [int(i) for i in order[: int(k)] if scores[i] > 0]
