"""A question's form, its names masked, read against exemplar questions (question_form.py)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.memories.text.question_form import (
    FORM_MARGIN,
    LOCAL_EXEMPLARS,
    NEAREST,
    STRICT_MARGIN,
    WHOLE_EXEMPLARS,
    QuestionForm,
    masked,
)
from engine.models.embedder import Embedder


def test_names_are_masked_but_a_one_word_name_opening_a_sentence_is_kept():
    names = ["Gesfound", "Siambous", "Tally"]  # "Tally" opens the question: the gathering's names take it
    assert masked("Tally the occasions on which the Gesfound put in at Siambous.", names) == (
        "Tally the occasions on which the someone put in at someone."
    )
    assert masked("Ilsa Varn met the Ferryman. Then Ilsa Varn left.", ["Ilsa Varn", "Ferryman"]) == (
        "someone met the someone. Then someone left."
    )
    # a name inside a longer word or after an initial's dot is not that name; its words apart by any space are
    assert masked("Did Ilsa\n Varn go?", ["Ilsa Varn"]) == "Did someone go?"
    assert masked("Did Carrowby or Carrow see A.Carrow?", ["Carrow"]) == "Did Carrowby or someone see A.Carrow?"


@pytest.mark.parametrize(
    ("question", "names", "whole"),
    [
        (
            "Arrange the Ferryman, the Archivist and the Cartographer by when Ilsa Varn met them.",
            ["Ilsa Varn", "Cartographer", "Archivist", "Ferryman"],
            True,
        ),
        ("Which rivers did Marco cross on the road south?", ["Marco"], True),
        ("Tell me the harbours the Veridian visited.", ["Veridian"], True),
        ("Where did Ilsa Varn meet the Ferryman?", ["Ilsa Varn", "Ferryman"], False),
        ("What did Dinah catch in the garden?", ["Dinah"], False),
        ("Why was the Hatter late for tea?", ["Hatter"], False),
    ],
)
def test_a_question_reads_as_whole_document_or_local_by_its_form(embedder, served_embedder, question, names, whole):
    for form in (QuestionForm(embedder), QuestionForm(served_embedder)):  # MiniLM, and as served (its adapter)
        assert form.reads_whole(question, names) is whole
        assert abs(form.margin(question, names) - FORM_MARGIN) > 0.02  # clear cases, not ones at the threshold


def test_the_margin_is_nearest_whole_exemplars_less_nearest_local_ones(embedder):
    form = QuestionForm(embedder)
    question, names = "Why was the Hatter late for tea?", ["Hatter"]
    vector = embedder.encode(["Why was the someone late for tea?"])[0]
    whole = np.sort(embedder.encode(list(WHOLE_EXEMPLARS)) @ vector)[-NEAREST:].mean()
    local = np.sort(embedder.encode(list(LOCAL_EXEMPLARS)) @ vector)[-NEAREST:].mean()
    assert form.margin(question, names) == pytest.approx(whole - local, abs=1e-6)
    # the exemplars' vectors are computed once an embedder, whichever session reads a form
    assert embedder.encode_fixed(WHOLE_EXEMPLARS) is embedder.encode_fixed(WHOLE_EXEMPLARS)
    assert QuestionForm(embedder).margin(question, names) == form.margin(question, names)
    # strict: a margin above STRICT_MARGIN, not FORM_MARGIN's
    for strict, bar in ((False, FORM_MARGIN), (True, STRICT_MARGIN)):
        assert Margin(embedder, bar + 0.001).reads_whole(question, names, strict)
        assert not Margin(embedder, bar).reads_whole(question, names, strict)
    assert FORM_MARGIN < STRICT_MARGIN
    # an exemplar asked as a question reads as its own set
    assert form.reads_whole(WHOLE_EXEMPLARS[0], []) and not form.reads_whole(LOCAL_EXEMPLARS[0], [])


class Margin(QuestionForm):
    """A form whose every question has the margin `value`."""

    def __init__(self, embedder: Embedder, value: float) -> None:
        super().__init__(embedder)
        self.value = value

    def margin(self, question: str, names: list[str]) -> float:
        return self.value
