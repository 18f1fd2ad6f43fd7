"""The tuning prompts' question recipes (``tune/prompts.py``), and the ``squad`` recipe's questions:
none from the design sample's text, its held-out articles apart."""

from __future__ import annotations

import random

import pytest

from blend_integrations.quality.squad import DESIGN_SEED, design_contexts, load_squad, retrieval_examples
from blend_integrations.tune import TuneOptions
from blend_integrations.tune.prompts import recipe_question, squad_split

CHUNK = "Short one. The scheduler hands every waiting request to the engine in turn. Done."


def test_the_sentence_recipe_asks_how_a_long_sentence_goes_on():
    question = recipe_question(CHUNK, random.Random(0), "sentence")
    assert question == 'How does the sentence that begins "The scheduler hands every waiting request" go on?'


def test_the_cloze_recipe_blanks_the_sentences_longest_word():
    question = recipe_question(CHUNK, random.Random(0), "cloze")
    assert question == (
        'Which word is missing from "The ___ hands every waiting request to the engine in turn."? '
        "Answer with that word."
    )


def test_the_cloze_recipe_keeps_punctuation_and_never_blanks_the_first_word():
    question = recipe_question("Sometimes we go up to the big valley.", random.Random(0), "cloze")
    assert question == 'Which word is missing from "Sometimes we go up to the big ___."? Answer with that word.'
    # no word of five letters or more after the first: nothing to ask
    assert recipe_question("Everything is as it was in the old mill by it.", random.Random(0), "cloze") is None
    assert recipe_question("Too short to ask.", random.Random(0), "cloze") is None


def test_an_unknown_recipe_is_refused_by_name():
    with pytest.raises(ValueError, match="recipe must be one of sentence, cloze, squad, got 'quiz'"):
        TuneOptions(recipe="quiz")
    with pytest.raises(ValueError, match="made by sentence or cloze, not 'squad'"):
        recipe_question(CHUNK, random.Random(0), "squad")


def test_the_squad_recipe_reads_no_design_text_and_holds_out_whole_articles():
    train = load_squad("train")
    reserved = design_contexts(train)
    tuning, held = squad_split(train, seed=0)
    # what calibration's probes and `benchmarks squad --split train` ask: their prompts' every paragraph
    examples, _ = retrieval_examples(train, 60, seed=DESIGN_SEED)
    assert set().union(*(e.documents for e in examples)) <= reserved
    assert len(reserved) > 2000  # 400 questions' 6 to 11 paragraphs each, some shared
    contexts = {q.paragraph.context for q in tuning + held}
    assert not contexts & reserved
    assert len(tuning) + len(held) == sum(q.paragraph.context not in reserved for q in train)
    articles = {q.paragraph.article for q in tuning}, {q.paragraph.article for q in held}
    assert not articles[0] & articles[1]
    assert len(articles[1]) == len(articles[0] | articles[1]) // 5
    # another seed holds out other articles
    assert {q.paragraph.article for q in squad_split(train, seed=1)[1]} != articles[1]
