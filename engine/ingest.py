"""Documents to segments, and the blocking ingestion loop a worker drives step by step."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.errors import BudgetExceededError
from engine.interface import DocumentInfo, IngestDone, IngestEvent, IngestProgress
from engine.memories import Memory, Segment


@dataclass(frozen=True)
class TokenizedDocument:
    id: str
    name: str
    text: str
    token_ids: list[int]
    token_spans: list[tuple[int, int]]

    def segments(self, segment_len: int) -> list[Segment]:
        return [
            Segment(
                document_id=self.id,
                index=i // segment_len,
                token_ids=self.token_ids[i : i + segment_len],
                token_spans=self.token_spans[i : i + segment_len],
            )
            for i in range(0, len(self.token_ids), segment_len)
        ]


def tokenize_document(tokenizer: PreTrainedTokenizerBase, document_id: str, name: str, text: str) -> TokenizedDocument:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return TokenizedDocument(
        id=document_id,
        name=name,
        text=text,
        token_ids=list(encoded["input_ids"]),
        token_spans=[(int(a), int(b)) for a, b in encoded["offset_mapping"]],
    )


def ingest_steps(
    memory: Memory,
    document: TokenizedDocument,
    *,
    segment_len: int,
    budget_bytes: int,
    on_commit: Callable[[DocumentInfo], None],
) -> Iterator[IngestEvent]:
    """Stage the document segment by segment, then commit; any exit before the commit aborts it."""
    started = time.perf_counter()
    segments = document.segments(segment_len)
    total_tokens = len(document.token_ids)
    memory.begin_document(document.id, document.text)
    committed = False
    try:
        done_tokens = 0
        for i, segment in enumerate(segments):
            memory.add_segment(segment)
            if memory.staged_bytes() > budget_bytes:
                raise BudgetExceededError(
                    f"document {document.id} outgrew the session's memory budget ({budget_bytes} bytes left)", 60.0
                )
            done_tokens += len(segment.token_ids)
            yield IngestProgress(document.id, i + 1, len(segments), done_tokens, total_tokens)
        memory.commit_document()
        committed = True
        info = DocumentInfo(
            id=document.id,
            name=document.name,
            chars=len(document.text),
            tokens=total_tokens,
            segments=len(segments),
            seconds=time.perf_counter() - started,
        )
        on_commit(info)
        yield IngestDone(info)
    finally:
        if not committed:
            memory.abort_document()
