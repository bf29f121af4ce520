"""Truncate and text memories: content, staging and rollback, offsets, limits, state round trips."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import replace
from itertools import pairwise
from typing import Any

import numpy as np
import pytest

from engine.errors import BudgetExceededError, InvalidRequestError, TooLargeError
from engine.ingest import ingest_steps, piece_bounds, tokenize_document
from engine.interface import DocumentInfo, IngestDone
from engine.memories import MemoryContext, Scope, build_memory
from engine.memories.text.memory import TextMemory
from engine.memories.text.store import Sentences, chunk_sentences, sentence_end, sentence_start
from tests.helpers import filler

FACT = "The secret harbour of Velmora is guarded by a lighthouse painted violet."


def limit_to(budget: int):
    """A `reserve` callback that refuses staged documents over `budget` bytes."""

    def reserve(nbytes: int) -> None:
        if nbytes > budget:
            raise BudgetExceededError(f"{nbytes} bytes staged; {budget} allowed")

    return reserve


def ingest(memory, tokenizer, doc_id: str, text: str, *, segment_len: int = 64, budget: int = 10**9) -> list:
    document = tokenize_document(tokenizer, doc_id, doc_id, text)
    committed: list[DocumentInfo] = []
    events = list(ingest_steps(memory, document, segment_len=segment_len, reserve=limit_to(budget), on_commit=committed.append))
    assert isinstance(events[-1], IngestDone)
    return committed


def text_memory(context: MemoryContext, options: dict[str, Any]) -> TextMemory:
    memory = build_memory("text", context, options)
    assert isinstance(memory, TextMemory)
    return memory


@pytest.fixture
def context(tiny_tokenizer, embedder) -> MemoryContext:
    return MemoryContext(tokenizer=tiny_tokenizer, embedder=embedder)


def test_unknown_memory_and_options_are_user_errors(context):
    with pytest.raises(InvalidRequestError, match="unknown memory"):
        build_memory("nope", context, {})
    with pytest.raises(InvalidRequestError, match="unknown memory options"):
        build_memory("text", context, {"top_kk": 3})
    with pytest.raises(InvalidRequestError, match="top_k"):
        build_memory("text", context, {"top_k": 0})


def test_truncate_keeps_the_tail_of_the_window(context, tiny_tokenizer):
    memory = build_memory("truncate", context, {"window_tokens": 50})
    text = filler(40) + " THE END OF THE BOOK."
    ingest(memory, tiny_tokenizer, "d1", text)
    pieces = memory.retrieve("what happened?", max_tokens=1000)
    assert len(pieces) == 1
    item = pieces[0].item
    assert item.char_end == len(text)
    assert text[item.char_start : item.char_end].endswith("THE END OF THE BOOK.")
    assert len(tiny_tokenizer(pieces[0].text, add_special_tokens=False)["input_ids"]) <= 52
    assert memory.stats().entries == 50 and memory.stats().documents == 1
    assert len(memory.retrieve("q", max_tokens=10)[0].text) < len(pieces[0].text)


def test_truncate_spans_documents_in_order(context, tiny_tokenizer):
    memory = build_memory("truncate", context, {"window_tokens": 400})
    ingest(memory, tiny_tokenizer, "a", "First document. " * 10)
    ingest(memory, tiny_tokenizer, "b", "Second document. " * 10)
    assert [p.item.document_id for p in memory.retrieve("q", 400)] == ["a", "b"]


@pytest.mark.parametrize("focus_tokens", [0, 128])
def test_text_memory_finds_the_fact_and_points_at_it(context, tiny_tokenizer, focus_tokens):
    memory = build_memory("text", context, {"chunk_tokens": 32, "top_k": 2, "focus_tokens": focus_tokens})
    text = filler(60) + " " + FACT + " " + filler(60)
    ingest(memory, tiny_tokenizer, "book", text)
    pieces = memory.retrieve("What colour is the lighthouse of Velmora?", max_tokens=1000)
    hit = [p for p in pieces if "violet" in p.text]
    assert hit, [p.text for p in pieces]
    item = hit[0].item
    assert text[item.char_start : item.char_end] == hit[0].text
    assert item.document_id == "book" and item.score is not None
    assert memory.stats().entries == pytest.approx(len(tiny_tokenizer(text)["input_ids"]) / 32, abs=4)


def test_text_retrieval_respects_the_token_budget(context, tiny_tokenizer):
    memory = build_memory("text", context, {"chunk_tokens": 32, "top_k": 4, "focus_tokens": 0})
    ingest(memory, tiny_tokenizer, "book", filler(100))
    pieces = memory.retrieve("river", max_tokens=70)
    tokens = sum(len(tiny_tokenizer(p.text, add_special_tokens=False)["input_ids"]) for p in pieces)
    assert 32 < tokens <= 70  # two chunks of 32 (merged into one excerpt when they touch)
    small = memory.retrieve("river", max_tokens=10)  # no full chunk fits; only the short last one may
    assert sum(len(tiny_tokenizer(p.text, add_special_tokens=False)["input_ids"]) for p in small) <= 10


@pytest.mark.parametrize("kind", ["truncate", "text"])
def test_aborted_document_leaves_earlier_documents_intact(context, tiny_tokenizer, kind):
    memory = build_memory(kind, context, {})
    ingest(memory, tiny_tokenizer, "kept", FACT + " " + filler(20))
    before = (memory.stats(), [p.text for p in memory.retrieve("Velmora lighthouse", 4000)])
    document = tokenize_document(tiny_tokenizer, "dropped", "dropped", filler(200))
    steps = ingest_steps(memory, document, segment_len=64, reserve=limit_to(10**9), on_commit=lambda d: None)
    next(steps), next(steps)
    assert isinstance(steps, Generator)
    steps.close()  # as when the client disconnects mid-ingestion
    assert (memory.stats(), [p.text for p in memory.retrieve("Velmora lighthouse", 4000)]) == before


def test_budget_exceeded_mid_document_rolls_back(context, tiny_tokenizer):
    memory = build_memory("text", context, {"chunk_tokens": 32})
    ingest(memory, tiny_tokenizer, "kept", filler(10))
    before = memory.stats()
    with pytest.raises(BudgetExceededError):
        ingest(memory, tiny_tokenizer, "big", filler(300), budget=4000)
    assert memory.stats() == before


def test_text_memory_chunk_limit(context, tiny_tokenizer):
    memory = build_memory("text", context, {"chunk_tokens": 16, "max_chunks": 5})
    with pytest.raises(BudgetExceededError, match="at most 5 chunks"):
        ingest(memory, tiny_tokenizer, "big", filler(30))
    assert memory.stats().entries == 0


@pytest.mark.parametrize(
    ("kind", "options"), [("truncate", {}), ("text", {}), ("text", {"focus_tokens": 48}), ("text", {"sentence_share": 0.5})]
)
def test_state_dict_round_trip(context, tiny_tokenizer, kind, options):
    memory = build_memory(kind, context, options)
    ingest(memory, tiny_tokenizer, "a", filler(50) + " " + FACT)
    ingest(memory, tiny_tokenizer, "b", filler(30))
    restored = build_memory(kind, context, options)
    restored.load_state_dict(memory.state_dict())
    assert restored.stats() == memory.stats()
    query = "Velmora lighthouse colour"
    assert restored.retrieve(query, 3000) == memory.retrieve(query, 3000)
    if kind == "text":
        for key in ("vectors", "sentence_starts", "sentence_spans", "sentence_vectors"):
            np.testing.assert_array_equal(restored.state_dict()[key], memory.state_dict()[key])


@pytest.mark.parametrize("options", [{"focus_tokens": 48}, {"sentence_share": 0.5}])
def test_sessions_saved_without_sentences_embed_them_again(context, tiny_tokenizer, options):
    """A session that keeps sentences, saved before sentences were kept, loads with the sentences it would have had."""
    memory = build_memory("text", context, options)
    ingest(memory, tiny_tokenizer, "a", filler(50) + " " + FACT)
    ingest(memory, tiny_tokenizer, "b", filler(30))
    state = {k: v for k, v in memory.state_dict().items() if not k.startswith("sentence_")}
    restored = build_memory("text", context, options)
    restored.load_state_dict(state)
    assert restored.stats() == memory.stats()
    for key in ("sentence_starts", "sentence_spans"):
        np.testing.assert_array_equal(restored.state_dict()[key], memory.state_dict()[key])
    loaded, saved = (m.state_dict()["sentence_vectors"].astype(np.float32) for m in (restored, memory))
    np.testing.assert_allclose(loaded, saved, atol=1e-3)  # batched differently: float rounding only


@pytest.mark.parametrize("options", [{}, {"focus_tokens": 48}, {"sentence_share": 0.5}])
def test_text_sessions_saved_by_another_embedder_embed_again(context, tiny_tokenizer, options):
    """Vectors saved by a server with another embedder (an adapter, or none) do not match this one's
    questions: they are made again from the chunks' texts, not loaded."""
    memory = build_memory("text", context, options)
    ingest(memory, tiny_tokenizer, "a", filler(50) + " " + FACT)
    state = memory.state_dict()
    assert state["embedder"] == context.embedder.name
    foreign = {**state, "embedder": "another-embedder", "vectors": np.zeros_like(state["vectors"])}
    foreign["sentence_vectors"] = np.zeros_like(state["sentence_vectors"])
    restored = build_memory("text", context, options)
    restored.load_state_dict(foreign)
    assert restored.remade_on_load  # so the engine saves it once made again
    for key in ("vectors", "sentence_vectors"):
        np.testing.assert_allclose(restored.state_dict()[key].astype(np.float32), state[key].astype(np.float32), atol=1e-3)
    query = "Velmora lighthouse colour"
    found = [[(p.text, p.item.char_start, p.item.char_end) for p in m.retrieve(query, 3000)] for m in (restored, memory)]
    assert found[0] == found[1]  # the same excerpts (scores differ in float rounding only)


def test_text_sessions_saved_before_embedders_were_named_are_plain_minilms(context, tiny_tokenizer):
    """A state without "embedder" was made by MiniLM without an adapter: loaded as it is there."""
    memory = build_memory("text", context, {})
    ingest(memory, tiny_tokenizer, "a", filler(50) + " " + FACT)
    legacy = {k: v for k, v in memory.state_dict().items() if k != "embedder"}
    marked = {**legacy, "vectors": legacy["vectors"] + 1.0}  # kept as saved, so the change shows
    restored = build_memory("text", context, {})
    restored.load_state_dict(marked)
    assert context.embedder.name == "all-MiniLM-L6-v2" and not restored.remade_on_load
    np.testing.assert_array_equal(restored.state_dict()["vectors"], marked["vectors"])


@pytest.mark.parametrize("kind", ["truncate", "text"])
def test_reset_forgets_everything(context, tiny_tokenizer, kind):
    memory = build_memory(kind, context, {})
    ingest(memory, tiny_tokenizer, "a", filler(20))
    memory.reset()
    assert memory.stats().entries == 0 and memory.stats().documents == 0
    assert memory.retrieve("anything", 1000) == []


def test_piecewise_tokenization_equals_whole_text(tiny_tokenizer, alice):
    tricky = "One  two\n\nthree\t four\u00a0five  \n six's 12 345 end.\r\n" * 40 + alice[:20000]
    for text in (alice, tricky):
        whole = tiny_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        document = tokenize_document(tiny_tokenizer, "d", "d", text)
        assert document.token_ids.tolist() == whole["input_ids"]
        assert [tuple(span) for span in document.token_spans.tolist()] == [tuple(s) for s in whole["offset_mapping"]]


def test_piece_bounds_cut_small_pieces_at_spaces(tiny_tokenizer, alice):
    bounds = list(piece_bounds(alice, 500))
    assert len(bounds) > 100 and bounds[0][0] == 0 and bounds[-1][1] == len(alice)
    assert all(a[1] == b[0] and alice[b[0]] == " " for a, b in pairwise(bounds))
    whole = tiny_tokenizer(alice, add_special_tokens=False)["input_ids"]
    assert tokenize_document(tiny_tokenizer, "d", "d", alice, piece_chars=500).token_ids.tolist() == whole


def test_tokenization_stops_soon_after_the_token_limit(tiny_tokenizer):
    text = filler(20000)  # ~300K tokens
    calls = []
    original = tiny_tokenizer.__class__.__call__

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny_tokenizer.__class__, "__call__", counting)
        with pytest.raises(TooLargeError, match="more than 1000 tokens"):
            tokenize_document(tiny_tokenizer, "d", "d", text, max_tokens=1000)
    assert len(calls) == 1 < len(list(piece_bounds(text)))


RARE = "Maintenance of the Z80 bootloader was handed to Quennell Ardmore in the spring."


@pytest.mark.parametrize("retrieval", ["hybrid", "lexical"])
def test_words_find_a_rare_name_among_look_alike_chunks(context, tiny_tokenizer, retrieval):
    """Every chunk reads alike to MiniLM; the rare name is found by BM25, alone or fused."""
    memory = build_memory("text", context, {"chunk_tokens": 32, "top_k": 2, "retrieval": retrieval})
    text = filler(150) + " " + RARE + " " + filler(150)
    ingest(memory, tiny_tokenizer, "book", text)
    pieces = memory.retrieve("Who was handed the Z80 bootloader, Quennell Ardmore?", max_tokens=1000)
    assert any("Quennell" in p.text for p in pieces), [p.text for p in pieces]


def test_score_fusion_at_either_end_weight_is_that_ranking_alone(context, tiny_tokenizer):
    """Score fusion with dense_weight 1 ranks as MiniLM alone, with 0 as BM25 alone (where BM25
    scores a chunk at all): the weights reach the two scores they name."""
    text = filler(60) + " " + FACT + " " + filler(60) + " " + RARE + " " + filler(60)
    question = "Who was handed the Z80 bootloader, and what colour is the Velmora lighthouse?"
    chosen: dict[str, list[int]] = {}
    settings: dict[str, dict[str, Any]] = {
        "dense": {"retrieval": "dense"},
        "lexical": {"retrieval": "lexical"},
        "as dense": {"dense_weight": 1.0},
        "as lexical": {"dense_weight": 0.0},
    }
    memory = text_memory(context, {"chunk_tokens": 16, "top_k": 4, "context_tokens": 64})
    ingest(memory, tiny_tokenizer, "book", text)  # once: these options change how it ranks, not what it stores
    base = memory.options
    for name, options in settings.items():
        memory.options = replace(base, **options)
        chosen[name] = [p.item.chunk_id for p in sorted(memory.retrieve(question, 1000), key=lambda p: -(p.item.score or 0.0))]
    assert chosen["as dense"] == chosen["dense"]
    assert chosen["as lexical"][: len(chosen["lexical"])] == chosen["lexical"]
    assert chosen["dense"] != chosen["lexical"]  # so the two ends do differ here


def test_score_fusion_is_the_weighted_sum_of_both_scores_standardized(context, tiny_tokenizer, embedder):
    """Each chunk's fused score is w·z(cosine) + (1 - w)·z(BM25) over all the session's chunks,
    best first; summed raw, BM25's larger numbers would decide alone. A question with no indexed
    word ranks by MiniLM; a session of one chunk still answers with it."""
    text = filler(60) + " " + FACT + " " + filler(60) + " " + RARE + " " + filler(60)
    memory = text_memory(context, {"chunk_tokens": 16, "dense_weight": 0.5})
    ingest(memory, tiny_tokenizer, "book", text)
    question = "Who was handed the Z80 bootloader, and what colour is the Velmora lighthouse?"
    vector = embedder.encode([question])[0]
    dense = memory.store.index.reconstruct_n(0, memory.store.index.ntotal) @ vector  # the chunks' cosines (unit vectors)
    lexical = memory.store.lexical.scores(question)
    standard = lambda a: (a - a.mean()) / a.std()  # noqa: E731
    expected = 0.5 * standard(dense) + 0.5 * standard(lexical)
    ordered = memory.ranking.ordered(question, vector)
    scores = [score for _, score in ordered]
    assert scores == sorted(scores, reverse=True) and scores[0] == pytest.approx(expected.max(), abs=1e-4)
    assert scores == pytest.approx(expected[[row for row, _ in ordered]], abs=1e-4)
    assert float(dense.max() - dense.min()) < 1 < float(lexical.max())  # summed raw, BM25 would decide
    vectors = memory.store.index.reconstruct_n(0, memory.store.index.ntotal)
    unworded = embedder.encode(["zzqx"])[0]
    by_meaning = np.argsort(-(vectors @ unworded), kind="stable")[:5].tolist()
    assert [row for row, _ in memory.ranking.ordered("zzqx", unworded)][:5] == by_meaning
    alone = build_memory("text", context, {"chunk_tokens": 64})
    ingest(alone, tiny_tokenizer, "note", FACT)
    assert alone.stats().entries == 1
    assert [p.text for p in alone.retrieve(question, 1000)] == [FACT]


def test_sentence_share_fuses_each_chunks_best_sentence(context, tiny_tokenizer, embedder):
    """With `sentence_share` s, MiniLM's part of the fused score is (1 - s)·z(the chunk's cosine) +
    s·z(its best sentence's cosine), the sentences pooled from the chunk's own pass; s 0 is the
    chunk's alone. A question matching one sentence of a chunk of other sentences scores that
    chunk further above the rest by its sentence than by its whole vector."""
    text = filler(60) + " " + FACT + " " + filler(60) + " " + RARE + " " + filler(60)
    question = "Which lighthouse guards the secret harbour?"
    vector = embedder.encode([question])[0]
    standard = lambda a: (a - a.mean()) / a.std()  # noqa: E731
    options = {"chunk_tokens": 64, "dense_weight": 0.8, "top_k": 8}
    shared = text_memory(context, {**options, "sentence_share": 0.6})
    plain = text_memory(context, options)
    for memory in (shared, plain):
        ingest(memory, tiny_tokenizer, "book", text)
    texts = shared.store.chunk_texts()
    parts = [chunk_sentences(t) for t in texts]
    chunks, sentences = embedder.encode_parts(texts, parts)
    dense = chunks @ vector
    best = np.asarray([(s @ vector).max() if len(s) else d for s, d in zip(sentences, dense, strict=True)])
    lexical = shared.store.lexical.scores(question)
    for memory, share in ((shared, 0.6), (plain, 0.0)):
        meaning = (1 - share) * standard(dense) + share * standard(best)
        expected = 0.8 * meaning + 0.2 * standard(lexical)
        ordered = memory.ranking.ordered(question, vector)
        assert [score for _, score in ordered] == pytest.approx(expected[[row for row, _ in ordered]], abs=2e-3)
    fact_chunk = next(i for i, t in enumerate(texts) if "violet" in t)
    assert len(parts[fact_chunk]) > 2 and best[fact_chunk] > dense[fact_chunk] + 0.05  # one sentence matches, not its chunk
    assert standard(best)[fact_chunk] > standard(dense)[fact_chunk]  # it stands further above the other chunks


def test_a_chunks_best_sentence_skips_zero_rows_and_chunks_without_sentences(context, tiny_tokenizer):
    """Each chunk's best sentence cosine is the largest over its own rows; a chunk without
    sentences, or whose rows are all zero (sentences past MiniLM's length), keeps its chunk's."""
    memory = text_memory(context, {"chunk_tokens": 16, "sentence_share": 0.5})
    ingest(memory, tiny_tokenizer, "book", filler(20))
    chunks = memory.store.index.ntotal
    counts = [(2, 0, 3, 1)[i % 4] for i in range(chunks)]
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((sum(counts), 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors[sum(counts[:3])] = 0.0  # chunk 3's one sentence: a zero row
    vectors[1] = 0.0  # one of chunk 0's two
    memory.store.sentences = Sentences.of(counts, [(0, 1)] * sum(counts), [vectors], 8)
    query = rng.standard_normal(8).astype(np.float32)
    dense = rng.standard_normal(chunks).astype(np.float32)
    best = memory.ranking._best_sentences(dense, query)
    starts = np.concatenate([[0], np.cumsum(counts)])
    stored = memory.store.sentences.vectors.astype(np.float32)
    for chunk in range(chunks):
        own = [stored[j] @ query for j in range(starts[chunk], starts[chunk + 1]) if stored[j].any()]
        assert best[chunk] == pytest.approx(max(own) if own else dense[chunk], abs=1e-5)
    assert chunks > 4 and best[3] == dense[3] and best[1] == dense[1]


@pytest.mark.parametrize(
    ("options", "kept"), [({"sentence_share": 0.5}, True), ({"sentence_share": 0.5, "fusion": "rank"}, False)]
)
def test_sentences_are_kept_only_where_they_are_used(context, tiny_tokenizer, options, kept):
    """sentence_share applies to score fusion: a session that inherits it with rank fusion keeps no sentence vectors."""
    memory = text_memory(context, {"chunk_tokens": 32, **options})
    ingest(memory, tiny_tokenizer, "book", filler(40) + " " + FACT)
    assert (len(memory.state_dict()["sentence_vectors"]) > 0) == kept


@pytest.mark.parametrize("options", [{"focus_tokens": 48}, {"sentence_share": 0.5}])
def test_the_estimate_counts_the_sentences_kept(context, tiny_tokenizer, options):
    """What ingestion reserves up front grows by at least what the sentences it keeps will hold,
    and covers what the committed document adds to the memory."""
    document = tokenize_document(tiny_tokenizer, "b", "b", filler(60) + " " + FACT)
    memory, plain = text_memory(context, options), text_memory(context, {})
    estimates = [m.estimate_bytes(len(document.text), len(document.token_ids)) for m in (memory, plain)]
    ingest(memory, tiny_tokenizer, "b", document.text)
    assert estimates[0] - estimates[1] >= memory.store.sentences.nbytes > 0
    assert estimates[0] >= memory.stats().bytes


@pytest.mark.parametrize("options", [{}, {"fusion": "rank"}, {"retrieval": "dense"}])
def test_ranked_spans_are_the_order_retrieval_takes_chunks_in(context, tiny_tokenizer, options):
    """`retrieve` with top_k k holds exactly the first k of `ranked_spans` (merged where they touch),
    excerpts as their chunks end (`sentence_tokens` 0)."""
    text = filler(60) + " " + FACT + " " + filler(60) + " " + RARE + " " + filler(60)
    memory = text_memory(context, {"chunk_tokens": 16, "top_k": 3, "context_tokens": 1000, "sentence_tokens": 0, **options})
    ingest(memory, tiny_tokenizer, "book", text)
    question = "Who was handed the Z80 bootloader, and what colour is the Velmora lighthouse?"
    ranked = memory.ranked_spans(question)
    assert len(ranked) >= 50 and len(set(ranked)) == len(ranked) and {d for d, _, _, _ in ranked} == {"book"}
    assert all(x[3] >= y[3] for x, y in pairwise(ranked))  # best first, with their scores
    pieces = memory.retrieve(question, 1000)
    first = ranked[:3]
    assert all(any(p.item.char_start <= a and b <= p.item.char_end for p in pieces) for _, a, b, _ in first)
    covered = sum(p.item.char_end - p.item.char_start for p in pieces)
    assert covered <= sum(b - a for _, a, b, _ in first) + 2 * len(first)  # nothing else (gaps of a space at most)


def test_margin_takes_only_chunks_scored_near_the_best(context, tiny_tokenizer):
    """`margin`: of the first `top_k` fused chunks, only those within `margin` of the best one's
    score reach the prompt; a margin wider than every gap takes what no margin takes."""
    text = filler(60) + " " + FACT + " " + filler(60) + " " + RARE + " " + filler(60)
    question = "Who was handed the Z80 bootloader, and what colour is the Velmora lighthouse?"
    options = {"chunk_tokens": 16, "top_k": 6, "context_tokens": 1000, "sentence_tokens": 0}
    plain = text_memory(context, options)
    ingest(plain, tiny_tokenizer, "book", text)
    ranked = plain.ranked_spans(question)
    scores = [score for _, _, _, score in ranked]
    assert scores[1] > scores[2]
    margin = scores[0] - (scores[1] + scores[2]) / 2  # between the second's gap and the third's
    base = plain.options
    taken = plain.retrieve(question, 1000)
    plain.options = replace(base, margin=margin)  # a margin changes how it reads, not what it stores
    pieces = plain.retrieve(question, 1000)
    assert sum(p.item.char_end - p.item.char_start for p in pieces) <= sum(b - a for _, a, b, _ in ranked[:2]) + 2
    assert all(any(p.item.char_start <= a and b <= p.item.char_end for p in pieces) for _, a, b, _ in ranked[:2])
    plain.options = replace(base, margin=100.0)
    assert plain.retrieve(question, 1000) == taken


@pytest.mark.parametrize("options", [{"fusion": "rank"}, {"retrieval": "dense"}, {"retrieval": "lexical"}])
def test_margin_is_inert_where_scores_are_not_fused_z_scores(context, tiny_tokenizer, options):
    """Rank fusion's and one ranking's scores are in other units: a margin (say, a model manifest's)
    changes nothing there rather than refusing the session."""
    text = filler(60) + " " + FACT + " " + filler(60) + " " + RARE + " " + filler(60)
    question = "Who was handed the Z80 bootloader, and what colour is the Velmora lighthouse?"
    memory = text_memory(context, {"chunk_tokens": 16, "top_k": 6, "sentence_tokens": 0, **options})
    ingest(memory, tiny_tokenizer, "book", text)
    taken = []
    for margin in (0.0, 1e-9):
        memory.options = replace(memory.options, margin=margin)
        taken.append(memory.retrieve(question, 1000))
    assert len(taken[0]) > 1 and taken[0] == taken[1]


@pytest.mark.parametrize("margin", [-1.0, 101.0])
def test_margin_out_of_range_is_refused(context, margin):
    with pytest.raises(InvalidRequestError, match="margin must be between 0"):
        build_memory("text", context, {"margin": margin})


def test_hybrid_retrieval_is_deterministic_and_merges_touching_chunks(context, tiny_tokenizer):
    text = filler(80) + " " + FACT + " " + RARE + " " + filler(80)
    runs = []
    for _ in range(2):
        memory = build_memory("text", context, {"chunk_tokens": 16, "top_k": 6, "context_tokens": 96, "focus_tokens": 0})
        ingest(memory, tiny_tokenizer, "book", text)
        runs.append(memory.retrieve("Velmora lighthouse colour and the Z80 bootloader's Quennell", max_tokens=1000))
    assert runs[0] == runs[1]
    spans = [(p.item.char_start, p.item.char_end) for p in runs[0]]
    assert spans == sorted(spans)  # document order
    assert all(a_end < b_start for (_, a_end), (b_start, _) in pairwise(spans))  # touching chunks were merged
    assert any(len(tiny_tokenizer(p.text, add_special_tokens=False)["input_ids"]) > 16 for p in runs[0])  # and some did touch
    assert all(text[a:b] == p.text for (a, b), p in zip(spans, runs[0], strict=True))


def test_focus_keeps_the_sentences_that_answer_with_their_spans(context, tiny_tokenizer):
    """focus_tokens: of the chosen chunks, only the sentences closest to the question (and the one
    after each) reach the prompt, within the budget, in document order, each pointing at its text."""
    text = filler(80) + " " + FACT + " " + RARE + " " + filler(80)
    options = {"chunk_tokens": 64, "top_k": 4, "context_tokens": 256, "focus_tokens": 0}
    whole = build_memory("text", context, options)
    focused = build_memory("text", context, {**options, "focus_tokens": 48})
    for memory in (whole, focused):
        ingest(memory, tiny_tokenizer, "book", text)
    question = "What colour is the lighthouse of Velmora?"
    chunks, runs = whole.retrieve(question, 1000), [focused.retrieve(question, 1000) for _ in range(2)]
    assert runs[0] == runs[1]  # deterministic
    pieces = runs[0]
    assert any(FACT.strip() in p.text for p in pieces), [p.text for p in pieces]
    assert sum(len(p.text) for p in pieces) <= 48 * 4 < sum(len(p.text) for p in chunks)
    spans = [(p.item.char_start, p.item.char_end) for p in pieces]
    assert spans == sorted(spans) and all(text[a:b] == p.text for (a, b), p in zip(spans, pieces, strict=True))
    inside = [(c.item.char_start, c.item.char_end) for c in chunks]
    assert all(any(ca <= a and b <= cb for ca, cb in inside) for a, b in spans)  # cut from the chosen chunks


def test_focus_costs_one_minilm_pass_a_question(context, tiny_tokenizer, monkeypatch):
    """The sentences' vectors come from the chunks' pass at ingestion: a question embeds itself only."""
    memory = build_memory("text", context, {"chunk_tokens": 64, "top_k": 4, "context_tokens": 256, "focus_tokens": 48})
    ingest(memory, tiny_tokenizer, "book", filler(80) + " " + FACT + " " + filler(80))
    embedded: list[str] = []
    encode = context.embedder.encode_parts

    def counted(texts, parts):
        embedded.extend(texts)
        return encode(texts, parts)

    monkeypatch.setattr(context.embedder, "encode_parts", counted)
    pieces = memory.retrieve("What colour is the lighthouse of Velmora?", 1000)
    assert embedded == ["What colour is the lighthouse of Velmora?"]
    assert any(FACT in p.text for p in pieces)


def test_sentence_vectors_pool_the_chunks_own_pass(embedder):
    """A part's vector is the mean of the chunk pass's states over the part's tokens: the whole
    text as its one part gives the text's own vector without [CLS] and [SEP], and nearly the same
    direction; a sentence's pooled vector is closer to that sentence alone than to another."""
    first, second = "The lighthouse of Velmora is painted violet.", "Bread was baked at dawn by the miller."
    text = first + " " + second
    (whole,), (parts,) = embedder.encode_parts([text], [[(0, len(text)), (0, len(first)), (len(first) + 1, len(text))]])
    assert float(parts[0] @ whole) > 0.98
    alone = embedder.encode([first, second])
    assert float(parts[1] @ alone[0]) > float(parts[1] @ alone[1])
    assert float(parts[2] @ alone[1]) > float(parts[2] @ alone[0])


def test_a_chunks_sentences_are_bounded_and_cover_it():
    text = " ".join(f"Line {i} ends here." for i in range(40))
    spans = chunk_sentences(text, limit=16)
    assert len(spans) == 16 and spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(spans))
    assert chunk_sentences("One. Two. Three.") == [(0, 4), (5, 9), (10, 16)]


def test_an_excerpt_widens_to_the_nearest_sentence_boundaries_in_reach():
    text = "Alpha one. Beta two three four.\nGamma five six."
    beta, gamma = text.index("Beta"), text.index("Gamma")
    whole = len(text) + 1
    assert sentence_start(text, beta + 3, reach=40, low=0) == beta
    assert sentence_end(text, beta + 3, reach=40, high=whole - 1) == gamma - 1  # up to the full stop
    assert sentence_start(text, beta + 3, reach=2, low=0) == beta + 3  # none in reach: as it was
    assert sentence_end(text, beta + 3, reach=2, high=whole - 1) == beta + 3
    assert sentence_start(text, 3, reach=8, low=0) == 0  # the text's own ends are boundaries
    assert sentence_end(text, len(text) - 4, reach=8, high=len(text)) == len(text)
    assert sentence_start(text, beta + 3, reach=40, low=beta + 1) == beta + 3  # never before the excerpt before
    assert sentence_end(text, beta + 3, reach=40, high=beta + 14) == beta + 3  # nor into the one after
    assert sentence_end('He said "go." Then', 10, reach=20, high=18) == 13  # the closing quote goes with it


def test_an_excerpt_on_sentence_boundaries_stays_as_it_is():
    """A token's span holds its leading space: a chunk that starts a sentence starts on the space
    before it, and one that ends a sentence may end after its line break. Neither takes in a
    neighbouring sentence."""
    text = "One two three four five. Six seven eight nine ten.\nEleven twelve."
    six, eleven = text.index(" Six"), text.index("Eleven")
    assert sentence_start(text, six, reach=200, low=0) == six + 1  # "Six", not "One"
    assert sentence_end(text, eleven, reach=200, high=len(text)) == eleven  # after the line break: not "Eleven twelve."
    assert sentence_end(text, eleven - 1, reach=200, high=len(text)) == eleven - 1  # at the full stop


def test_excerpts_are_widened_to_whole_sentences_within_the_budget(context, tiny_tokenizer):
    fact = FACT[:-1] + ", which the old keepers of the northern coast repainted every spring before the boats came home."
    text = filler(40) + " " + fact + " " + filler(40)
    question = "What colour is the lighthouse of Velmora?"
    cut = text_memory(context, {"chunk_tokens": 16, "top_k": 1, "sentence_tokens": 0})
    whole = text_memory(context, {"chunk_tokens": 16, "top_k": 1})
    for memory in (cut, whole):
        ingest(memory, tiny_tokenizer, "book", text)
    [chunk] = cut.retrieve(question, 1000)
    assert fact not in chunk.text and "Velmora" in chunk.text  # part of the fact's sentence
    [piece] = whole.retrieve(question, 1000)
    assert piece.text == fact and text[piece.item.char_start : piece.item.char_end] == fact
    chunk_tokens = len(tiny_tokenizer(chunk.text, add_special_tokens=False)["input_ids"])
    [tight] = whole.retrieve(question, chunk_tokens)  # no room to widen: the chunk as it was cut
    assert tight.text == chunk.text
    [start_only] = whole.retrieve(question, chunk_tokens + 3)  # room for the sentence's first words, not its end
    assert start_only.text.startswith("The secret harbour") and start_only.text.endswith(chunk.text.rstrip())


def test_widened_excerpts_never_overlap(context, tiny_tokenizer):
    """Two chosen chunks of one long sentence, a chunk apart: each widens towards the sentence's
    ends, and stops where the other begins."""
    sentence = "Velmora velmora opens it, " + "then a plain stretch of common words, " * 6 + "and velmora velmora ends it."
    text = filler(30) + " " + sentence + " " + filler(30)
    memory = text_memory(context, {"chunk_tokens": 16, "top_k": 2, "sentence_tokens": 256})
    ingest(memory, tiny_tokenizer, "book", text)
    pieces = memory.retrieve("velmora", 1000)
    spans = [(p.item.char_start, p.item.char_end) for p in pieces]
    at = text.index(sentence)
    assert len(pieces) == 2 and spans[0][0] == at and spans[1][1] == at + len(sentence)  # widened to the sentence's ends
    assert spans == sorted(spans) and all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(spans))
    assert all(text[a:b] == p.text for (a, b), p in zip(spans, pieces, strict=True))


def test_excerpts_of_two_documents_widen_each_in_its_own(context, tiny_tokenizer):
    """The excerpt before or after bounds widening only within one document."""
    memory = text_memory(context, {"chunk_tokens": 16, "top_k": 2})
    sentence = "Velmora velmora starts this long sentence, " + "and a plain stretch of common words runs on, " * 3 + "to its end."
    texts = {name: filler(20) + " " + sentence + " " + filler(20) for name in ("first", "second")}
    for name, text in texts.items():
        ingest(memory, tiny_tokenizer, name, text)
    pieces = memory.retrieve("velmora", 1000)
    assert [p.item.document_id for p in pieces] == ["first", "second"]
    for piece in pieces:
        text = texts[piece.item.document_id]
        start, end = piece.item.char_start, piece.item.char_end
        assert text[start:end] == piece.text and start <= text.index(sentence) < end
        assert text[start - 2 : start] == ". " and piece.text.endswith(".")  # whole sentences, in each document


def test_bad_retrieval_options_are_user_errors(context):
    for options in (
        {"retrieval": "magic"},
        {"context_tokens": 8},
        {"rrf_k": 0},
        {"focus_tokens": 40_000},
        {"fusion": "max"},
        {"dense_weight": 1.5},
        {"sentence_tokens": 600},
        {"sentence_share": -0.1},
        {"sentence_share": 1.5},
    ):
        with pytest.raises(InvalidRequestError):
            build_memory("text", context, options)


def test_the_estimate_is_reserved_under_the_ingest_lock_before_anything_is_staged(context, tiny_tokenizer):
    """ingest_steps runs under the session's ingest lock: the estimate it reserves there sees the
    memory as it will be written, whatever other documents did while this one waited."""
    memory = build_memory("text", context, {})
    calls: list[str | int] = []
    original_begin = memory.begin_document

    def begin(document_id: str, text: str, tokens: int) -> None:
        calls.append("begin")
        original_begin(document_id, text, tokens)

    memory.begin_document = begin  # type: ignore[method-assign]  # a spy on the method
    document = tokenize_document(tiny_tokenizer, "d", "d", filler(40))
    estimate = memory.estimate_bytes(len(document.text), len(document.token_ids))
    steps = ingest_steps(memory, document, segment_len=64, reserve=lambda n: calls.append(n), on_commit=lambda d: None)
    list(steps)
    assert calls[:2] == [estimate, "begin"] and len(calls) > 3


@pytest.mark.parametrize("options", [{}, {"fusion": "rank"}, {"gather": True}])
def test_text_retrieval_keeps_to_the_documents_named(context, tiny_tokenizer, options):
    memory = text_memory(context, options)
    lighthouse = "The lighthouse of Velmora is painted green and white. " * 3
    ingest(memory, tiny_tokenizer, "a", filler(30) + " " + lighthouse)
    ingest(memory, tiny_tokenizer, "b", filler(30) + " " + lighthouse.replace("green", "blue"))
    ingest(memory, tiny_tokenizer, "c", filler(60))
    question = "What colour is the lighthouse of Velmora?"
    both = {p.item.document_id for p in memory.retrieve(question, 1000)}
    assert {"a", "b"} <= both  # the same facts in two documents: both are found
    for only in ("a", "b", "c"):
        pieces = memory.retrieve(question, 1000, Scope(frozenset({only})))
        assert pieces and {p.item.document_id for p in pieces} == {only}
    assert {p.item.document_id for p in memory.retrieve(question, 1000, Scope(frozenset({"a", "c"})))} <= {"a", "c"}
    assert memory.retrieve(question, 1000, Scope(frozenset({"unknown"}))) == []
    assert memory.retrieve(question, 1000, Scope()) == memory.retrieve(question, 1000)
