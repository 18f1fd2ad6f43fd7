"""Answer quality, beside the layers: metrics for generated replies, as the quality benchmark and the
examples score them: normalized exact match, answer contained in the reply,
and token F1. The normalization is SQuAD's official one (``squad.py`` scores
against the best of a question's answers with these)."""

from __future__ import annotations

import re
import string
from collections import Counter

PUNCTUATION = frozenset(string.punctuation)
ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize(text: str) -> str:
    """SQuAD v1.1's answer normalization: lowercase, drop punctuation, drop the
    articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answer: str) -> float:
    return float(normalize(prediction) == normalize(answer))


def contains(prediction: str, answer: str) -> float:
    """1.0 when the answer appears in the reply: chat models answer in a sentence."""
    return float(normalize(answer) in normalize(prediction))


def token_f1(prediction: str, answer: str) -> float:
    pred, gold = normalize(prediction).split(), normalize(answer).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)
