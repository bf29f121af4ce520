"""The `text` memory's options: how documents are chunked and how a question ranks and cuts them."""

from __future__ import annotations

from dataclasses import dataclass

RETRIEVALS = ("hybrid", "dense", "lexical")
FUSIONS = ("score", "rank")


@dataclass(frozen=True)
class TextOptions:
    chunk_tokens: int = 128
    top_k: int = 4  # at most this many chunks
    context_tokens: int = 512  # and at most this many tokens of them (needles: docs/studies/retrieval.md)
    retrieval: str = "hybrid"
    fusion: str = "score"  # hybrid: "score" (weighted z-scores) or "rank" (reciprocal rank fusion)
    dense_weight: float = 0.3  # score fusion: MiniLM's weight, BM25's is 1 - this (docs/studies/retrieval.md#score-fusion)
    rrf_k: int = 60  # rank fusion
    max_chunks: int = 200_000
    focus_tokens: int = 0  # > 0: of the chosen chunks, only their best sentences, this many tokens; 0: whole chunks
    rerank: int = 0  # > 0: the chunks are chosen from this many best fused ones, reordered by the reader
    sentence_tokens: int = 50  # whole chunks: at most about this many tokens added at each end, to whole sentences
    margin: float = 0.0  # > 0: a chunk is taken only when its fused score is within this of the first taken's
    sentence_share: float = 0.0  # score fusion: of MiniLM's weight, the share of each chunk's best sentence's similarity
    gather: bool = False  # whole-document questions get every sentence naming the question's names (gather.py)
    gather_tokens: int = 2048  # at most this many tokens of them; a local question's exact matches at most lookup_tokens
    lookup_tokens: int = 256
    gather_chunks: int | None = None  # beside a whole-document gathering, at most this many ranked chunks (None: top_k)
    # a question whose names the documents repeat (more sentences than a lookup takes), or whose best sentences
    # leave some of its names out, is a whole-document one, whatever its words, when its form reads as one
    # (question_form.py) and every mention fits gather_tokens (gather.py); so is one whose names stand in two to
    # four sentences, all alike, when its form reads clearly as one
    gather_recurring: bool = False
    # a question about a named chapter (book, part...) or the ending ranks only the chunks there, and
    # an ending gets the place's last tail_tokens too (locate.py)
    locate: bool = False
    tail_tokens: int = 768
    # the served model writes a summary tree of each document in the background (summary.py): parts
    # of summary_part_tokens, summary_fanout summaries to one above; a whole-document question gets
    # at most summary_tokens of them before the ranked excerpts
    summarize: bool = False
    summary_part_tokens: int = 2048
    summary_fanout: int = 8
    summary_tokens: int = 768

    def __post_init__(self) -> None:
        if not 16 <= self.chunk_tokens <= 512:
            raise ValueError("chunk_tokens must be between 16 and 512")
        if not 1 <= self.top_k <= 64:
            raise ValueError("top_k must be between 1 and 64")
        if not self.chunk_tokens <= self.context_tokens <= 32_768:
            raise ValueError("context_tokens must be between chunk_tokens and 32768")
        if self.retrieval not in RETRIEVALS:
            raise ValueError(f"retrieval must be one of {list(RETRIEVALS)}")
        if self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {list(FUSIONS)}")
        if not 0.0 <= self.dense_weight <= 1.0:
            raise ValueError("dense_weight must be between 0 and 1")
        if not 1 <= self.rrf_k <= 1000:
            raise ValueError("rrf_k must be between 1 and 1000")
        if self.max_chunks < 1:
            raise ValueError("max_chunks must be positive")
        if self.rerank and not self.top_k <= self.rerank <= 64:
            raise ValueError(f"rerank must be 0 (off) or between top_k ({self.top_k}) and 64")
        if not 0 <= self.focus_tokens <= 32_768:
            raise ValueError("focus_tokens must be between 0 and 32768 (0: whole chunks)")
        if not 0 <= self.sentence_tokens <= 512:
            raise ValueError("sentence_tokens must be between 0 and 512 (0: excerpts end where their chunks do)")
        if not 0.0 <= self.margin <= 100.0:
            raise ValueError("margin must be between 0 (off) and 100")
        if not 0.0 <= self.sentence_share <= 1.0:
            raise ValueError("sentence_share must be between 0 and 1")
        if not isinstance(self.gather, bool) or not isinstance(self.gather_recurring, bool):
            raise ValueError("gather and gather_recurring must be true or false")
        if not (1 <= self.gather_tokens <= 32_768 and 1 <= self.lookup_tokens <= 32_768):
            raise ValueError("gather_tokens and lookup_tokens must be between 1 and 32768")
        if self.gather_chunks is not None and not 0 <= self.gather_chunks <= 64:
            raise ValueError("gather_chunks must be between 0 and 64, or null (top_k)")
        if not isinstance(self.locate, bool):
            raise ValueError("locate must be true or false")
        if not 16 <= self.tail_tokens <= 32_768:
            raise ValueError("tail_tokens must be between 16 and 32768")
        if not isinstance(self.summarize, bool):
            raise ValueError("summarize must be true or false")
        if not self.chunk_tokens <= self.summary_part_tokens <= 8_192:
            raise ValueError("summary_part_tokens must be between chunk_tokens and 8192")
        if not 2 <= self.summary_fanout <= 32:
            raise ValueError("summary_fanout must be between 2 and 32")
        if not 16 <= self.summary_tokens <= 32_768:
            raise ValueError("summary_tokens must be between 16 and 32768")

    def score_fusion(self) -> bool:
        return (self.retrieval, self.fusion) == ("hybrid", "score")

    def keeps_sentences(self) -> bool:
        """Whether each chunk's sentences get vectors at ingestion: for `focus_tokens`, or for
        `sentence_share` where it applies (score fusion)."""
        return self.focus_tokens > 0 or (self.sentence_share > 0 and self.score_fusion())

    def score_margin(self) -> float:
        """`margin` where scores are fused z-scores (hybrid, score fusion, no rerank); 0 elsewhere,
        where it would be in other units. Not refused there: a model's manifest may set a margin
        that a session choosing rank fusion or rerank inherits."""
        return self.margin if self.score_fusion() and not self.rerank else 0.0
