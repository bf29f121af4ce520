"""Whether a question reads as a whole-document one by its form, whatever its words.

The gathering's rules know a whole-document question by its words (how many, every, first, last,
more often, in what order: gather.WHOLE_DOCUMENT). Asked otherwise ("Tally the occasions on which
the X put in at Y.", "Where did X travel as envoy? Give the towns.") it reads as a local one. Where
a question's names recur in the documents, the rules cannot tell the two apart by counts alone: a
local question about a recurring character names as many sentences as a count does.

So the question, its names masked ("Tally the occasions on which the someone put in at someone."),
is embedded by the memory's MiniLM and set beside two sets of exemplar questions written for this
(none of them from a benchmark): ones whose answer is pieced together from every mention, and ones a
single passage answers. It reads as a whole-document one when its mean similarity to its NEAREST
closest whole-document exemplars passes that to the closest local ones by more than FORM_MARGIN
(chosen on the development records and QA questions: docs/studies/wholedoc.md). Where a lookup would
already hand over every sentence naming the question's names (a few, all alike; with one hop and
ranked chunks beside them), the form must read clearly as one: by more than STRICT_MARGIN (chosen
on the development data too: above every such development QA question's margin, 0.036 at most,
below every such list's, 0.107 at least).
"""

from __future__ import annotations

import re

import numpy as np

from engine.memories.text.gather import name_pattern, opens_sentence
from engine.models.embedder import Embedder

WHOLE_EXEMPLARS = (
    "How many times does the bell ring?",
    "Name every city the merchant traded in.",
    "Which ports did the captain visit? Give them all.",
    "Who was the last king of the valley?",
    "Who held the office first?",
    "Put the three storms in the order they struck.",
    "Did the baker or the smith visit the mill more often?",
    "On how many occasions did the two brothers quarrel?",
    "List the guests at the feast.",
    "Which places did the pilgrim pass through on his way?",
    "In what order did the children leave home?",
    "How often does the narrator mention the river?",
    "Who among the suitors arrived earliest?",
    "What towns did the army march through?",
    "On what occasions did the mayor speak at the hall?",
    "Arrange the four letters by when they were written.",
    "Tally the days the ferry did not sail.",
    "Where all did the regiment camp? Give the places.",
    "Which of the three sisters married first, and which last?",
    "What were the names of the horses the farmer owned over the years?",
    "Which inns did the coachman stop at along the road?",
    "Rank the rivals by how often they won.",
    "What are all the gifts the prince received?",
)
LOCAL_EXEMPLARS = (
    "What colour was the coat the captain wore at the wedding?",
    "Why did Maria leave the farm?",
    "Where does the letter say the money is hidden?",
    "What did the doctor give the child for the fever?",
    "Who wrote the note left on the table?",
    "What does the old man say about the war?",
    "How old was the girl when her father died?",
    "What animal did the hunter see by the stream?",
    "What was the name of the ship that sank?",
    "Which town was the soldier born in?",
    "What gift did the queen send to the bishop?",
    "How much did the horse cost?",
    "What does the sister reply when asked about the ring?",
    "Where did the two friends meet at night?",
    "What did the judge say when the prisoner was brought in?",
    "How did the boy escape from the tower?",
    "What was written on the sign above the door?",
    "Who opened the gate for the travellers?",
    "What reason does the widow give for selling the house?",
    "In which room was the clock found?",
    "What did the fisherman catch on the morning of the storm?",
    "What did the merchant's daughter ask for?",
    "Where was the treaty signed?",
)
NEAREST = 3
FORM_MARGIN = 0.03
STRICT_MARGIN = 0.07
MASK = "someone"


def masked(question: str, names: list[str]) -> str:
    """The question with each of its `names` (longest first) put as MASK: its form, not its subject.
    A name of one word that opens a sentence is left: it may be a verb ("Tally", "Arrange")."""
    for name in sorted(names, key=len, reverse=True):
        question = _masked_name(question, name)
    return question


def _masked_name(question: str, name: str) -> str:
    one_word = " " not in name

    def put(match: re.Match[str]) -> str:
        return match.group(0) if one_word and opens_sentence(question, match.start()) else MASK

    return name_pattern([name]).sub(put, question)  # as the gathering finds it


class QuestionForm:
    """Reads questions' forms with `embedder`; the exemplars are embedded once an embedder, when first needed."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder

    def margin(self, question: str, names: list[str]) -> float:
        """Mean cosine to the NEAREST closest whole-document exemplars less that to the closest local ones."""
        vector = self.embedder.encode([masked(question, names)])[0]
        whole, local = (
            np.sort(self.embedder.encode_fixed(exemplars) @ vector)[-NEAREST:].mean()
            for exemplars in (WHOLE_EXEMPLARS, LOCAL_EXEMPLARS)
        )
        return float(whole - local)

    def reads_whole(self, question: str, names: list[str], strict: bool = False) -> bool:
        """Whether the question's form reads as a whole-document one: its margin above FORM_MARGIN
        (`strict`: above STRICT_MARGIN)."""
        return self.margin(question, names) > (STRICT_MARGIN if strict else FORM_MARGIN)
