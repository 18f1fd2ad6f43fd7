"""The tuning prompts' question recipes (``tune/prompts.py``)."""

from __future__ import annotations

import random

import pytest

from blend_integrations.tune import TuneOptions
from blend_integrations.tune.prompts import recipe_question

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
    with pytest.raises(ValueError, match="recipe must be one of sentence, cloze, got 'quiz'"):
        TuneOptions(recipe="quiz")
