"""Answer quality, beside the layers: a BM25 retriever (Okapi BM25, written here: a few dozen
lines, no dependency), which gives a question its documents as a user's retriever would: the
SQuAD benchmark's prompts and calibration's probes from a user's own questions."""

from __future__ import annotations

import heapq
import math
import re
from collections import Counter
from collections.abc import Sequence

# Words too common to say what a paragraph is about, questions' own words among them
STOP_WORDS = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "been", "by", "did", "do", "does", "for", "from", "had", "has",
    "have", "he", "her", "his", "how", "in", "is", "it", "its", "of", "on", "or", "she", "that", "the", "their",
    "they", "this", "to", "was", "were", "what", "when", "where", "which", "who", "whom", "whose", "why", "will",
    "with",
})  # fmt: skip


def tokens(text: str) -> list[str]:
    """Lowercase word tokens without stop words, as BM25 indexes and queries them."""
    return [t for t in re.findall(r"\w+", text.lower()) if t not in STOP_WORDS]


class BM25:
    """Okapi BM25 over a fixed list of documents: a query's score in a document
    sums, over the query's distinct terms, idf * tf * (k1 + 1) / (tf + k1 *
    (1 - b + b * length / average length)), with idf = ln(1 + (N - n + 0.5) /
    (n + 0.5)) for a term in n of the N documents (never negative)."""

    def __init__(self, documents: Sequence[str], k1: float = 1.5, b: float = 0.75):
        counts = [Counter(tokens(d)) for d in documents]
        lengths = [sum(c.values()) for c in counts]
        average = max(sum(lengths) / max(len(lengths), 1), 1e-9)  # no division by zero for an empty corpus
        self.k1 = k1
        # per document, the tf-independent part of the denominator
        self.norms = [k1 * (1 - b + b * length / average) for length in lengths]
        self.postings: dict[str, list[tuple[int, int]]] = {}  # term -> (document, tf) for each document holding it
        for doc, c in enumerate(counts):
            for term, tf in c.items():
                self.postings.setdefault(term, []).append((doc, tf))
        n = len(documents)
        self.idf = {t: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()}

    def scores(self, query: str) -> dict[int, float]:
        """Each document sharing a term with the query -> its score (the others score 0)."""
        scores: dict[int, float] = {}
        for term in set(tokens(query)):
            for doc, tf in self.postings.get(term, ()):
                gain = self.idf[term] * tf * (self.k1 + 1) / (tf + self.norms[doc])
                scores[doc] = scores.get(doc, 0.0) + gain
        return scores

    def top(self, query: str, k: int) -> list[int]:
        """The k best documents for the query, best first (ties in document order)."""
        scores = self.scores(query)
        return heapq.nsmallest(k, range(len(self.norms)), key=lambda doc: (-scores.get(doc, 0.0), doc))
