"""BM25 over a text memory's chunks (bm25s, English stop words and Snowball stemming).

bm25s indexes a fixed corpus, so the index is rebuilt from every chunk of the session when a
document is committed or a saved session loaded: about 0.1-0.15 s per thousand chunks of 128 tokens
on 2 cores, so adding documents one by one to a large session costs more each time (an incremental
index is not done yet).
"""

from __future__ import annotations

import bm25s
import numpy as np
import Stemmer

_VOCAB_ENTRY_BYTES = 120  # a Python dict entry with its short str key and int value


class LexicalIndex:
    def __init__(self) -> None:
        self._stemmer = Stemmer.Stemmer("english")  # one per index: a stemmer is not thread-safe
        self._bm25: bm25s.BM25 | None = None
        self.size = 0

    def _tokens(self, texts: list[str], *, ids: bool):
        return bm25s.tokenize(texts, stopwords="english", stemmer=self._stemmer, return_ids=ids, show_progress=False)

    def build(self, texts: list[str]) -> LexicalIndex:
        """A new index of `texts` (chunk i is texts[i]); this one is left as it was."""
        index = LexicalIndex()
        index.size = len(texts)
        tokens = self._tokens(texts, ids=True) if texts else None
        if tokens is not None and tokens.vocab:  # chunks of stop words and 1-letter words only: nothing to index
            index._bm25 = bm25s.BM25()
            index._bm25.index(tokens, show_progress=False)
        return index

    def scores(self, query: str) -> np.ndarray:
        """float32 [size]: each chunk's BM25 score for `query` (0 where no query term occurs)."""
        if self._bm25 is None:
            return np.zeros(self.size, np.float32)
        terms = [t for t in self._tokens([query], ids=False)[0] if t in self._bm25.vocab_dict]
        if not terms:
            return np.zeros(self.size, np.float32)
        return np.asarray(self._bm25.get_scores(terms), np.float32)

    def term_scores(self, query: str, texts: list[str]) -> np.ndarray:
        """float32 [len(texts)]: for each text, the summed IDF (over this index's chunks) of the
        query's terms it holds; a lexical score for pieces of chunks, such as sentences."""
        if self._bm25 is None or not texts:
            return np.zeros(len(texts), np.float32)
        frequency = np.diff(self._bm25.scores["indptr"])  # chunks holding each term id
        idf: dict[str, float] = {}
        for term in set(self._tokens([query], ids=False)[0]):
            term_id = self._bm25.vocab_dict.get(term)
            if term_id is not None and term_id < len(frequency):
                df = float(frequency[term_id])
                idf[term] = float(np.log1p((self.size - df + 0.5) / (df + 0.5)))
        if not idf:
            return np.zeros(len(texts), np.float32)
        held = self._tokens(texts, ids=False)
        return np.asarray([sum(idf.get(term, 0.0) for term in set(terms)) for terms in held], np.float32)

    @property
    def nbytes(self) -> int:
        if self._bm25 is None:
            return 0
        arrays = sum(a.nbytes for a in self._bm25.scores.values() if isinstance(a, np.ndarray))
        return arrays + _VOCAB_ENTRY_BYTES * len(self._bm25.vocab_dict)

    @staticmethod
    def bytes_per_chunk(chunk_tokens: int) -> int:
        """An estimate per chunk, used while a document is staged (committed chunks are counted
        exactly): each distinct term (at most one a token) costs a float32 score and an int32
        index; English prose adds about 2 new vocabulary words a 128-token chunk after the first
        thousand (measured on the QA texts), estimated here as up to 32."""
        return chunk_tokens * 8 + 32 * _VOCAB_ENTRY_BYTES
