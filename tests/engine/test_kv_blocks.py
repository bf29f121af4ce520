"""Keys and values held in blocks as answers fill them (engine/runtime/kv_blocks.py, the batcher's
growth, waiting and preemption): every answer comes out as it does alone, the memory held covers
what is allocated at every step, and all of it is given back."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
import torch

from engine.config import SessionLimits
from engine.errors import BudgetExceededError, TooLargeError
from engine.interface import GenerationParams
from engine.models.llama_step import BatchDecoder, Row
from engine.runtime.kv_blocks import KVBlocks
from engine.runtime.scheduler import Batcher
from engine.runtime.worker import SerialWorker
from engine.sessions.store import SessionStore
from research.lms.byte_tokenizer import ByteTokenizer
from tests.engine.test_batching import NO_STOP, alone, collect, requests, same_answer, tiny

BLOCK = 4


def bytes_per_token(decoder: BatchDecoder) -> int:
    return 2 * len(decoder.layers) * decoder.kv_heads * decoder.head_dim * decoder.cache_dtype.itemsize


def blocks_batcher(model, server_bytes: int, wait_seconds: float = 60.0) -> tuple[Batcher, SessionStore]:
    """A batcher whose rows hold blocks of BLOCK positions from a store of `server_bytes`; each step
    checks that what the rows hold covers the keys and values they have."""
    decoder = BatchDecoder(model)
    store = SessionStore(SessionLimits(server_memory_bytes=server_bytes))
    kv = KVBlocks(lambda n: store.reserve(None, n, transient=True), BLOCK, bytes_per_token(decoder), wait_seconds)
    step = decoder.step

    def checked_step(rows: list[Row]) -> torch.Tensor:
        for row in rows:
            assert row.keys is not None and row.values is not None and row.kv is not None
            assert row.keys.nbytes + row.values.nbytes <= row.kv.nbytes == row.blocks * BLOCK * kv.bytes_per_token
        assert store.reserved_bytes <= server_bytes
        return step(rows)

    decoder.step = checked_step  # type: ignore[method-assign]
    return Batcher(decoder, SerialWorker("test", 16), cast(Any, ByteTokenizer()), NO_STOP, 8, None, kv), store


async def answers(batcher: Batcher, asked: list) -> list:
    return await asyncio.gather(*(collect(batcher, prompt, params) for prompt, params in asked))


def test_rows_grow_block_by_block_and_answer_as_alone():
    model, tokenizer = tiny("llama", 101), ByteTokenizer()
    asked = requests(101)
    batcher, store = blocks_batcher(model, 10**9)
    got = asyncio.run(answers(batcher, asked))
    assert all(same_answer(g, alone(model, tokenizer, p, q)) for g, (p, q) in zip(got, asked, strict=True))
    assert batcher.kv is not None and batcher.kv.preemptions == 0
    assert batcher.kv.in_use == 0 and store.reserved_bytes == 0


def test_short_memory_preempts_the_youngest_and_resumes_it_with_the_same_tokens():
    """Three long answers (one sampled) in room for about two and a half: rows are admitted while
    each could still grow once, then the youngest is preempted when one needs more, and resumed by
    feeding its prompt and answer again; every answer is the one it gives alone."""
    model, tokenizer = tiny("llama", 101), ByteTokenizer()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 101, (n,), generator=generator).tolist() for n in (3, 5, 7)]
    params = [GenerationParams(max_tokens=40, temperature=0.0)] * 2 + [
        GenerationParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7)
    ]
    asked = list(zip(prompts, params, strict=True))
    per_token = bytes_per_token(BatchDecoder(model))
    batcher, store = blocks_batcher(model, 110 * per_token)
    got = asyncio.run(answers(batcher, asked))
    assert all(same_answer(g, alone(model, tokenizer, p, q)) for g, (p, q) in zip(got, asked, strict=True))
    assert batcher.kv is not None and batcher.kv.preemptions > 0
    assert batcher.kv.in_use == 0 and store.reserved_bytes == 0


def test_rows_wait_for_memory_and_answer_as_alone():
    model, tokenizer = tiny("llama", 101), ByteTokenizer()
    asked = requests(101)
    batcher, store = blocks_batcher(model, 100 * bytes_per_token(BatchDecoder(model)))
    got = asyncio.run(answers(batcher, asked))
    assert all(same_answer(g, alone(model, tokenizer, p, q)) for g, (p, q) in zip(got, asked, strict=True))
    assert batcher.kv is not None and batcher.kv.in_use == 0 and store.reserved_bytes == 0


def test_an_answer_that_could_never_fit_fails_and_one_that_waits_too_long_fails():
    model = tiny("llama", 101)
    per_token = bytes_per_token(BatchDecoder(model))
    batcher, store = blocks_batcher(model, 24 * per_token, wait_seconds=0.2)
    params = GenerationParams(max_tokens=4, temperature=0.0)
    with pytest.raises(TooLargeError):
        asyncio.run(collect(batcher, list(range(40)), params))
    held = store.reserve(None, 20 * per_token, transient=True)  # another's work holds most of it
    with pytest.raises(BudgetExceededError):
        asyncio.run(collect(batcher, list(range(5)), params))

    async def two_at_once() -> list:
        return await asyncio.gather(*(collect(batcher, list(range(5)), params) for _ in range(2)), return_exceptions=True)

    assert all(isinstance(result, BudgetExceededError) for result in asyncio.run(two_at_once()))
    held.release()
    assert batcher.kv is not None and batcher.kv.in_use == 0 and store.reserved_bytes == 0
    text, done = asyncio.run(collect(batcher, list(range(5)), params))  # once it is given back, the same answer fits
    assert done.completion_tokens == 4


def test_holding_fewer_blocks_gives_bytes_back_and_a_refusal_keeps_what_was_held():
    store = SessionStore(SessionLimits(server_memory_bytes=1000))
    kv = KVBlocks(lambda n: store.reserve(None, n, transient=True), 10, 10)
    row = Row([1, 2, 3], GenerationParams())
    assert kv.hold(row, 5, extra_bytes=100) and store.reserved_bytes == 600 and kv.in_use == 5
    assert kv.hold(row, 3) and store.reserved_bytes == 300 and kv.in_use == 3
    assert not kv.hold(row, 11) and store.reserved_bytes == 300 and row.blocks == 3
    kv.release(row)
    kv.release(row)
    assert store.reserved_bytes == 0 and kv.in_use == 0
