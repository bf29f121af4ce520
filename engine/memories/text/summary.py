"""A summary tree of each document (RAPTOR-style), written by the served model in the background.

Level 1 summarizes each part of a document: consecutive chunks of at most `summary_part_tokens`
tokens. Level 2 summarizes `summary_fanout` consecutive level-1 summaries, and so on up to one
summary of the whole document. The tree is planned from the chunks alone, so the same document
always gets the same parts; a node is written once its children are (engine/summarize.py asks
`tasks` for work, runs the model, and hands the text back to `add`).

A whole-document question (how a book or chapter ends, what happens, in what order, a summary)
gets summaries before the ranked excerpts (`pieces`): for a question naming a place (locate.py),
the level-1 summaries inside it, in order; otherwise each document's top summary, then the level-1
summaries nearest the question by MiniLM, in document order. Questions asked while the tree is
being built use what is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.memories.base import SummaryTask

SUMMARY_QUESTION = re.compile(
    r"\b(summar\w*|what happens|what happened|story|plot|overall|themes?|ends?|ending|ended|in what order|"
    r"in which order|what order|which order|sequence|timeline|order)\b",
    re.IGNORECASE,
)
PART_WORDS, WORDS_PER_CHILD = 60, 15  # what each summary is asked to keep to
PART_PROMPT = (
    "Here is one part of a longer document.\n\n{text}\n\nSummarize this part in at most {words} words: "
    "who appears and what happens, in the order it happens. Keep the names as they are written."
)
# a small model asked to summarize summaries copies the first; one sentence each keeps every part
HIGHER_PROMPT = (
    "Here are summaries of {count} consecutive parts of a longer document, in order.\n\n{text}\n\nRetell them as one "
    "account of at most {words} words, one sentence for each part, in the same order, keeping the names as they are written."
)
NODE_OVERHEAD_BYTES = 256  # a node's record besides its text and vector


def is_summary_question(question: str) -> bool:
    return bool(SUMMARY_QUESTION.search(question))


@dataclass(frozen=True)
class Node:
    document_id: str
    level: int
    index: int  # its place in its level
    start: int  # the characters of the document it covers
    end: int
    text: str

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.document_id, self.level, self.index)


def part_spans(spans: np.ndarray, tokens: np.ndarray, part_tokens: int) -> list[tuple[int, int]]:
    """(start, end) characters of a document's parts: consecutive chunks (`spans`, `tokens` in
    document order) of at most `part_tokens` tokens together, a chunk larger than that alone."""
    groups: list[list[int]] = []
    used = 0
    for row, count in enumerate(tokens.tolist()):
        if not groups or used + count > part_tokens:
            groups.append([])
            used = 0
        groups[-1].append(row)
        used += count
    return [(int(spans[group[0]][0]), int(spans[group[-1]][1])) for group in groups]


def level_sizes(parts: int, fanout: int) -> list[int]:
    """How many nodes each level has, level 1 first, up to the level of one node."""
    sizes = [parts] if parts else []
    while sizes and sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // fanout))
    return sizes


class SummaryTree:
    """The written nodes of every document's tree, and their MiniLM vectors (row i: node i)."""

    def __init__(self, dim: int, part_tokens: int, fanout: int) -> None:
        self.dim, self.part_tokens, self.fanout = dim, part_tokens, fanout
        self.nodes: list[Node] = []
        self.vectors = np.zeros((0, dim), np.float32)
        self._at: dict[tuple[str, int, int], int] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def planned(self, parts: dict[str, list[tuple[int, int]]]) -> int:
        """Nodes the trees of these documents ({id: part spans}) have when whole."""
        return sum(sum(level_sizes(len(spans), self.fanout)) for spans in parts.values())

    def tasks(
        self, parts: dict[str, list[tuple[int, int]]], texts: dict[str, str], limit: int, busy: frozenset[Any]
    ) -> list[SummaryTask]:
        """Up to `limit` nodes that can be written now and are not `busy` (keys in flight): in
        document order, the lowest level first."""
        found: list[SummaryTask] = []
        for document_id, spans in parts.items():
            sizes = level_sizes(len(spans), self.fanout)
            for level, size in enumerate(sizes, start=1):
                for index in range(size):
                    if len(found) >= limit:
                        return found
                    key = (document_id, level, index)
                    if key in self._at or key in busy:
                        continue
                    task = self._task(key, spans, texts[document_id])
                    if task is not None:
                        found.append(task)
        return found

    def _task(self, key: tuple[str, int, int], spans: list[tuple[int, int]], text: str) -> SummaryTask | None:
        document_id, level, index = key
        if level == 1:
            start, end = spans[index]
            prompt = PART_PROMPT.format(text=text[start:end].strip(), words=PART_WORDS)
            return SummaryTask(key, [{"role": "user", "content": prompt}], _tokens(PART_WORDS), start, end)
        children = [self._at.get((document_id, level - 1, i)) for i in range(index * self.fanout, (index + 1) * self.fanout)]
        below = level_sizes(len(spans), self.fanout)[level - 2]
        children = children[: below - index * self.fanout]
        if any(child is None for child in children):
            return None
        nodes = [self.nodes[i] for i in children if i is not None]
        joined = "\n\n".join(f"{n}. {node.text}" for n, node in enumerate(nodes, start=1))
        words = WORDS_PER_CHILD * len(nodes)
        prompt = HIGHER_PROMPT.format(count=len(nodes), text=joined, words=words)
        return SummaryTask(key, [{"role": "user", "content": prompt}], _tokens(words), nodes[0].start, nodes[-1].end)

    def add(self, task: SummaryTask, text: str, vector: np.ndarray) -> None:
        document_id, level, index = task.key
        node = Node(document_id, level, index, task.start, task.end, text.strip())
        self._at[node.key] = len(self.nodes)
        self.nodes.append(node)
        self.vectors = np.concatenate([self.vectors, vector.reshape(1, self.dim).astype(np.float32)])

    def has(self, key: Any) -> bool:
        return key in self._at

    def pieces(
        self,
        query_vector: np.ndarray,
        allowed: frozenset[str],
        places: list[tuple[str, int, int]],
        max_tokens: int,
        count: Callable[[str], int],
        tops: frozenset[tuple[str, int, int]],
    ) -> list[tuple[Node, str]]:
        """The summaries a whole-document question gets, each with its text framed for the reader,
        at most `max_tokens` (by `count`): inside the `places` ((document id, start, end)), the
        lowest level that fits, in order; else each document's top node (`tops`: the keys of whole
        documents' summaries), then level-1 nodes by similarity, in document order."""
        if places:
            for level in range(1, 1 + max((node.level for node in self.nodes), default=0)):
                inside = [
                    (node, framed(node, node.key in tops))
                    for node in sorted(self.nodes, key=_place)
                    if node.level == level
                    and any(d == node.document_id and node.start < e and node.end > s for d, s, e in places)
                ]
                if inside and sum(count(text) for _, text in inside) <= max_tokens:
                    return inside
            return []
        chosen: list[tuple[Node, str]] = []
        used = 0
        for node in self.nodes:
            if node.key in tops and node.document_id in allowed and node.level > 1:
                text = framed(node, True)
                if used + count(text) <= max_tokens:
                    chosen.append((node, text))
                    used += count(text)
        rows = [i for i, node in enumerate(self.nodes) if node.level == 1 and node.document_id in allowed]
        scores = self.vectors[rows] @ query_vector.astype(np.float32) if rows else np.zeros(0)
        parts: list[tuple[Node, str]] = []
        for row in np.asarray(rows, np.int64)[np.argsort(-scores, kind="stable")].tolist():
            node = self.nodes[row]
            text = framed(node, node.key in tops)
            if used + count(text) > max_tokens:
                break
            parts.append((node, text))
            used += count(text)
        return chosen + sorted(parts, key=lambda pair: _place(pair[0]))

    def _restore(self, nodes: list[Node], vectors: np.ndarray) -> None:
        self.nodes, self.vectors = nodes, np.ascontiguousarray(vectors, np.float32).reshape(-1, self.dim)
        self._at = {node.key: i for i, node in enumerate(nodes)}

    def reset(self) -> None:
        self._restore([], np.zeros((0, self.dim), np.float32))

    @property
    def nbytes(self) -> int:
        return self.vectors.nbytes + sum(len(node.text.encode()) + NODE_OVERHEAD_BYTES for node in self.nodes)

    def node_bytes(self, max_tokens: int) -> int:
        """At most what one more node takes: its text (16 bytes a token at worst), record and vector."""
        return 16 * max_tokens + NODE_OVERHEAD_BYTES + 4 * self.dim

    def state_dict(self) -> dict[str, Any]:
        nodes = self.nodes
        return {
            "summary_documents": [node.document_id for node in nodes],
            "summary_places": np.asarray([(n.level, n.index, n.start, n.end) for n in nodes], np.int64).reshape(-1, 4),
            "summary_texts": [node.text for node in nodes],
            "summary_vectors": self.vectors.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A saved tree; a session saved before summaries existed has none."""
        documents = list(state.get("summary_documents", []))
        places = np.asarray(state.get("summary_places", np.zeros((0, 4))), np.int64).reshape(-1, 4).tolist()
        texts = list(state.get("summary_texts", []))
        nodes = [
            Node(d, level, index, start, end, text)
            for d, (level, index, start, end), text in zip(documents, places, texts, strict=True)
        ]
        self._restore(nodes, np.asarray(state.get("summary_vectors", np.zeros((0, self.dim))), np.float32))


def framed(node: Node, whole: bool) -> str:
    """A node as the reader sees it."""
    where = "the whole document" if whole else f"part {node.index + 1}" if node.level == 1 else "several parts"
    return f"[Summary of {where}] {node.text}"


def _place(node: Node) -> tuple[str, int]:
    return (node.document_id, node.start)


def _tokens(words: int) -> int:
    return 2 * words  # room for the words asked for and a little over
