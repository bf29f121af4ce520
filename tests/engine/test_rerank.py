"""Reranking by the reader (text memory's `rerank`): the batched score is each passage's own, the
chunks chosen are the ones the reader scores best, and an answer reserves the pass's estimate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.errors import InvalidRequestError
from engine.memories import MemoryContext, build_memory
from engine.memories.text.memory import TextMemory
from engine.memories.text.rerank import QUESTION_TOKENS, _pair, frame_tokens, pass_bytes, question_ids, question_likelihood
from tests.engine.test_memories import FACT, RARE, ingest
from tests.helpers import TEXT, filler, new_session

QUESTION = "What colour is the lighthouse that guards the secret harbour of Velmora?"


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def _alone(model, tokenizer, passage: str, question: str) -> float:
    """The score the long way: one passage, the whole model, every position's logits."""
    ids, asked = _pair(tokenizer, passage, question_ids(tokenizer, question))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    log_probs = torch.log_softmax(logits[-asked - 1 : -1], -1)
    return float(log_probs.gather(-1, torch.tensor(ids[-asked:])[:, None]).mean())


def test_a_batched_score_is_each_passages_own(tiny_model, tiny_tokenizer):
    """Right padding and the head run on the question's positions only change nothing: passages
    of different lengths, more than one batch of them, each scored as if alone."""
    passages = [filler(n) for n in (3, 40, 11, 25, 7, 60, 2, 33, 19, 5)]
    batched = question_likelihood(tiny_model, tiny_tokenizer, passages, QUESTION)
    alone = [_alone(tiny_model, tiny_tokenizer, p, QUESTION) for p in passages]
    assert batched == pytest.approx(alone, abs=1e-4)
    assert len(set(round(s, 4) for s in batched)) > 1  # the passages really score differently


def test_only_the_start_of_a_long_question_is_scored(tiny_model, tiny_tokenizer):
    """A question of thousands of tokens costs no more than its first QUESTION_TOKENS."""
    start = " ".join(["harbour"] * QUESTION_TOKENS)
    long = start + " " + filler(3000)
    assert len(question_ids(tiny_tokenizer, long)) == QUESTION_TOKENS
    passages = [FACT, RARE]
    assert question_likelihood(tiny_model, tiny_tokenizer, passages, long) == pytest.approx(
        question_likelihood(tiny_model, tiny_tokenizer, passages, start), abs=1e-5
    )


def test_rerank_chooses_the_chunks_the_reader_scores_best(tiny_model, tiny_tokenizer, embedder):
    context = MemoryContext(tokenizer=tiny_tokenizer, embedder=embedder, model=tiny_model)
    text = filler(120) + " " + FACT + " " + filler(60) + " " + RARE + " " + filler(120)
    runs = []
    for _ in range(2):
        memory = build_memory("text", context, {"chunk_tokens": 32, "top_k": 2, "rerank": 6, "sentence_tokens": 0})
        ingest(memory, tiny_tokenizer, "book", text)
        runs.append(memory.retrieve(QUESTION, max_tokens=1000))
    assert runs[0] == runs[1]  # deterministic
    fused = TextMemory(context, {"chunk_tokens": 32})
    ingest(fused, tiny_tokenizer, "book", text)
    rows = [row for row, _ in fused.ranking.ranked(QUESTION, embedder.encode([QUESTION])[0])[:6]]  # the six best fused
    candidates = [fused.store.chunk_texts()[row] for row in rows]
    scores = question_likelihood(tiny_model, tiny_tokenizer, candidates, QUESTION)
    best = sorted(range(6), key=lambda i: -scores[i])[:2]
    chosen = "".join(p.text for p in runs[0])
    assert all(candidates[i] in chosen for i in best)  # the two (merged into one excerpt if they touch)
    assert len(chosen) <= sum(len(candidates[i]) for i in best)  # and nothing else
    assert max(p.item.score or -1e9 for p in runs[0]) == pytest.approx(max(scores), abs=1e-4)


def test_rerank_options_are_checked(tiny_model, tiny_tokenizer, embedder):
    with_model = MemoryContext(tokenizer=tiny_tokenizer, embedder=embedder, model=tiny_model)
    for options in ({"rerank": 2, "top_k": 4}, {"rerank": 65, "top_k": 4}, {"rerank": -1}):
        with pytest.raises(InvalidRequestError, match="rerank"):
            build_memory("text", with_model, options)
    without = MemoryContext(tokenizer=tiny_tokenizer, embedder=embedder)
    with pytest.raises(InvalidRequestError, match="language model"):
        build_memory("text", without, {"rerank": 8})


def test_an_answer_reserves_the_larger_of_its_cache_and_the_pass(tiny_model, tiny_tokenizer, embedder):
    context = MemoryContext(tokenizer=tiny_tokenizer, embedder=embedder, model=tiny_model)
    plain = build_memory("text", context, {})
    reranking = build_memory("text", context, {"rerank": 64, "chunk_tokens": 512, "context_tokens": 512})
    pass_peak = pass_bytes(tiny_model.config, 512 + frame_tokens(tiny_tokenizer) + QUESTION_TOKENS, 64, 4)
    assert pass_peak > 100  # the tiny model's cache at 1 byte a token is smaller
    assert plain.answer_bytes(10, 20, 100, 1) == (0, 100)
    assert reranking.answer_bytes(10, 20, 100, 1) == (0, pass_peak)


def test_a_reranking_session_answers_over_http(make_client):
    """The option through REST: one excerpt, scored by the reader; a bad value is a 400."""
    client = make_client()
    session_id = new_session(client, memory="text", options={"rerank": 4, "top_k": 1})
    assert client.post(f"/v1/sessions/{session_id}/documents", json={"text": TEXT}).status_code == 201
    body = client.post(f"/v1/sessions/{session_id}/ask", json={"question": "Who ran by the river?", "max_tokens": 4}).json()
    items = body["retrieval"]["items"]
    assert len(items) == 1 and items[0]["score"] < 0  # a mean log-probability, not a fused score
    refused = client.post("/v1/sessions", json={"memory": "text", "options": {"rerank": 2, "top_k": 4}})
    assert refused.status_code == 400 and "rerank" in refused.json()["error"]["message"]
