"""Training episodes for Neurocache: a batch row is one document, cut into equal segments.

Three kinds of episode:
- language modelling: a window of a long training text;
- retrieval tasks in the chat format: a fact (a pass key) stated once in filler text, outside the
  last segment, and in the last segment a question about it with the answer. The answer tokens
  are scored on their own, so the instruct model learns to answer from the cache. Optional
  distractors: other facts in the needle's very form ("The door code is 60419. ...") whose numbers
  share digits with the key, so that a digit's nearest match is often the wrong one and only the
  words "pass key" tell the facts apart;
- facts in prose (research/training/fact_tasks.py), placed and asked the same way, with facts about
  other people as distractors: the answer repeats the fact's words.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from research.training.fact_tasks import NAMES, facts


@dataclass(frozen=True)
class Episode:
    token_ids: list[int]  # n_segments * segment_len
    answer_mask: list[bool]  # targets scored as the retrieval answer (label positions)
    kind: str

    def segment(self, index: int, segment_len: int) -> tuple[list[int], list[bool]]:
        start = index * segment_len
        return self.token_ids[start : start + segment_len], self.answer_mask[start : start + segment_len]


def tokenize_files(tokenizer: PreTrainedTokenizerBase, files: Sequence[Path]) -> list[int]:
    ids: list[int] = []
    for path in files:
        ids.extend(tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
    return ids


def chat_turn(tokenizer: PreTrainedTokenizerBase, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(question turn in the chat template, answer tokens ending with the end-of-turn marker)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    end = tokenizer.eos_token or ""
    q_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return q_ids, tokenizer(f"{answer}{end}", add_special_tokens=False)["input_ids"]


def passkey_prompt(tokenizer: PreTrainedTokenizerBase, key: str) -> tuple[list[int], list[int]]:
    return chat_turn(tokenizer, "What is the pass key? Answer with the number.", f"The pass key is {key}.")


DISTRACTOR_NAMES = (
    "door code",
    "room number",
    "ticket number",
    "order number",
    "locker code",
    "serial number",
    "account number",
    "phone extension",
)


def needle(tokenizer: PreTrainedTokenizerBase, key: str, name: str = "pass key") -> list[int]:
    return tokenizer(f" The {name} is {key}. Remember it. {key} is the {name}. ", add_special_tokens=False)["input_ids"]


def near_miss(rng: random.Random, key: str) -> str:
    """Another 5-digit number sharing most of its digits with `key`: one or two digits changed,
    or two swapped."""
    while True:
        digits = list(key)
        if rng.random() < 0.3:
            i, j = rng.sample(range(len(digits)), 2)
            digits[i], digits[j] = digits[j], digits[i]
        else:
            for i in rng.sample(range(len(digits)), rng.choice((1, 2))):
                digits[i] = str(rng.randrange(10))
        other = "".join(digits)
        if other != key and other[0] != "0":
            return other


class EpisodeSampler:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        corpus: list[int],
        *,
        segment_len: int,
        n_segments: int,
        passkey_ratio: float,
        seed: int,
        distractors: int = 0,
        repeats: float = 0.0,
        fact_ratio: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.corpus = corpus
        self.segment_len, self.n_segments = segment_len, n_segments
        self.length = segment_len * n_segments
        if len(corpus) <= self.length:
            raise ValueError("the training corpus is shorter than one episode")
        if distractors < 0 or not 0.0 <= repeats <= 1.0:
            raise ValueError("distractors must be >= 0 and repeats between 0 and 1")
        if min(passkey_ratio, fact_ratio) < 0.0 or passkey_ratio + fact_ratio > 1.0:
            raise ValueError("passkey_ratio and fact_ratio must be >= 0 and sum to at most 1")
        self.passkey_ratio, self.fact_ratio = passkey_ratio, fact_ratio
        if fact_ratio and distractors >= len(NAMES):
            raise ValueError(f"fact episodes need a name per fact: at most {len(NAMES) - 1} distractors")
        self.distractors = distractors  # at most this many distractor facts per pass-key or fact episode
        self.repeats = repeats  # share of keys made to hold some digit twice or more
        self.rng = random.Random(seed)

    def _window(self, n: int) -> list[int]:
        start = self.rng.randrange(0, len(self.corpus) - n)
        return self.corpus[start : start + n]

    def language_episode(self) -> Episode:
        return Episode(self._window(self.length), [False] * self.length, "lm")

    def _key(self) -> str:
        key = list(str(self.rng.randrange(10_000, 100_000)))
        if self.repeats and self.rng.random() < self.repeats:
            i = self.rng.randrange(len(key) - 1)  # digit i again at a later place, or in a run
            for j in self.rng.sample(range(i + 1, len(key)), self.rng.choice((1, 2)) if i < len(key) - 2 else 1):
                key[j] = key[i]
        return "".join(key)

    def passkey_episode(self) -> Episode:
        key = self._key()
        q_ids, a_ids = passkey_prompt(self.tokenizer, key)
        others = [
            needle(self.tokenizer, near_miss(self.rng, key), self.rng.choice(DISTRACTOR_NAMES))
            for _ in range(self.rng.randint(0, self.distractors) if self.distractors else 0)
        ]
        return self._task_episode(needle(self.tokenizer, key), others, q_ids, a_ids, "passkey")

    def fact_episode(self) -> Episode:
        """A fact in prose about one person among distractor facts about others, then a question
        about it; the answer repeats the fact's words."""
        told = facts(self.rng, 1 + (self.rng.randint(0, self.distractors) if self.distractors else 0))
        q_ids, a_ids = chat_turn(self.tokenizer, told[0].question, told[0].answer)
        pieces = [self.tokenizer(f" {f.statement} ", add_special_tokens=False)["input_ids"] for f in told]
        return self._task_episode(pieces[0], pieces[1:], q_ids, a_ids, "fact")

    def _task_episode(self, fact: list[int], others: list[list[int]], q_ids: list[int], a_ids: list[int], kind: str) -> Episode:
        """Filler with `fact` wholly before the last segment, where the question and answer are;
        the distractors go anywhere before the question."""
        filler = self._window(self.length - len(q_ids) - len(a_ids) - len(fact) - sum(map(len, others)))
        room = self.length - self.segment_len - len(fact) - sum(map(len, others))
        if room < 1:
            raise ValueError(
                "the fact and its distractors do not fit before the last segment: use fewer distractors or longer episodes"
            )
        inserts = [(self.rng.randrange(0, room), fact)] + [(self.rng.randrange(0, len(filler)), o) for o in others]
        body = filler
        for cut, piece in sorted(inserts, key=lambda item: item[0], reverse=True):
            body = body[:cut] + piece + body[cut:]
        ids = body + q_ids + a_ids
        answer = [False] * (len(body) + len(q_ids)) + [True] * len(a_ids)
        assert len(ids) == self.length, (len(ids), self.length)
        return Episode(ids, answer, kind)

    def sample(self) -> Episode:
        draw = self.rng.random()
        if draw < self.passkey_ratio:
            return self.passkey_episode()
        if draw < self.passkey_ratio + self.fact_ratio:
            return self.fact_episode()
        return self.language_episode()
