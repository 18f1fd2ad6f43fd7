"""Calibration, measurement: the probe prompts calibration asks, made from the user's documents,
and from the user's own questions where there are some."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from ..chat import rag_prompt
from ..quality.retrieval import BM25

QUESTIONS = (
    "What do the documents say about {topic}?",
    "According to the documents, what is true of {topic}?",
    "Which document mentions {topic}, and what does it say?",
    "Answer briefly: what is said about {topic}?",
)
MIN_PROBE_TOKENS = 8  # a document shorter than this (alone) tells nothing about blending


def _topic(document: str, rng: random.Random) -> str:
    """A few words from one sentence of ``document``: what a probe asks about."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", document) if len(s.split()) >= 3]
    words = rng.choice(sentences).split() if sentences else document.split()
    start = rng.randrange(max(1, len(words) - 3))
    return " ".join(words[start : start + 4]).strip(" ,.;:!?\"'()")


def probe_prompts(engine: Any, documents: Sequence[str], count: int, seed: int, per_prompt: int = 4) -> list:
    """``count`` probe prompts from ``documents``: random subsets of up to
    ``per_prompt`` in random orders, each with a question about one of them,
    in the RAG layout of the integrations (``chat.rag_prompt``)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        docs = rng.sample(list(documents), min(per_prompt, len(documents)))
        question = rng.choice(QUESTIONS).format(topic=_topic(rng.choice(docs), rng))
        prompts.append(rag_prompt(docs, question, engine.tokenizer, engine.config.separator))
    return prompts


def question_probes(
    engine: Any, documents: Sequence[str], questions: Sequence[str], count: int, seed: int, per_prompt: int = 4
) -> list:
    """``count`` probe prompts of the user's own ``questions`` (shuffled, each
    asked once before any is asked again): each with the ``per_prompt``
    documents a BM25 retriever ranks first for it, in its order, as a RAG
    application's retriever gives them."""
    rng = random.Random(seed)
    index = BM25(documents)
    order: list[str] = []
    while len(order) < count:
        batch = list(questions)
        rng.shuffle(batch)
        order += batch
    return [
        rag_prompt(
            [documents[d] for d in index.top(q, min(per_prompt, len(documents)))],
            q,
            engine.tokenizer,
            engine.config.separator,
        )
        for q in order[:count]
    ]
