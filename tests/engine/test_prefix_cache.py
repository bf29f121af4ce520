"""A session's next prompt starts from the keys and values of the prefix it shares with its last one
(engine/runtime/prefix_cache.py): the answer is the one the whole prompt gives, the logits equal a
full recomputation's, scopes never share, and what is kept is reserved and given back when answers
need the memory."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
import torch

from engine.config import SessionLimits
from engine.interface import GenerationParams
from engine.models.llama_step import BatchDecoder, Row
from engine.runtime.kv_blocks import KVBlocks
from engine.runtime.prefix_cache import PrefixCache, common_prefix
from engine.runtime.scheduler import Batcher
from engine.runtime.worker import SerialWorker
from engine.sessions.store import SessionStore
from research.lms.byte_tokenizer import ByteTokenizer
from tests.engine.test_batching import NO_STOP, alone, answer_of, same_answer, tiny
from tests.engine.test_kv_blocks import BLOCK, bytes_per_token

GREEDY = GenerationParams(max_tokens=12, temperature=0.0)


def prefix_batcher(model, server_bytes: int, max_tokens: int = 1000) -> tuple[Batcher, SessionStore, PrefixCache]:
    decoder = BatchDecoder(model)
    store = SessionStore(SessionLimits(server_memory_bytes=server_bytes))

    def reserve(n: int) -> Any:
        return store.reserve(None, n, transient=True)

    kv = KVBlocks(reserve, BLOCK, bytes_per_token(decoder), 60.0)
    prefix = PrefixCache(reserve, max_tokens, least=4)
    worker = SerialWorker("test", 16)
    return Batcher(decoder, worker, cast(Any, ByteTokenizer()), NO_STOP, 8, None, kv, prefix), store, prefix


async def ask(batcher: Batcher, prompt: list[int], scope: str | None, params: GenerationParams = GREEDY):
    return answer_of([event async for event in batcher.generate(prompt, params, scope=scope)])


def prompts(shared: int, *tails: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    head = torch.randint(0, 101, (shared,), generator=generator).tolist()
    return [head + torch.randint(0, 101, (n,), generator=generator).tolist() for n in tails]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [1]) == 0


def test_a_second_prompt_starts_from_the_shared_prefix_and_answers_as_alone():
    model, tokenizer = tiny("llama", 101), ByteTokenizer()
    first, second, third = prompts(20, 9, 14, 3)
    batcher, store, prefix = prefix_batcher(model, 10**9)
    sampled = GenerationParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    got = [
        asyncio.run(ask(batcher, first, "s")),
        asyncio.run(ask(batcher, second, "s")),
        asyncio.run(ask(batcher, third, "s", sampled)),
        asyncio.run(ask(batcher, third, "s", sampled)),  # all of it kept but the last token
    ]
    want = [
        alone(model, tokenizer, p, q) for p, q in zip([first, second, third, third], [GREEDY] * 2 + [sampled] * 2, strict=True)
    ]
    assert all(same_answer(g, w) for g, w in zip(got, want, strict=True))
    assert prefix.hits == 3 and prefix.reused_tokens == 20 + 20 + len(third) - 1
    assert prefix.tokens == len(third)
    kept = store.reserved_bytes
    assert kept == len(third) * bytes_per_token(BatchDecoder(model))  # float32 model: its own dtype
    prefix.drop("s")
    assert prefix.tokens == 0 and store.reserved_bytes == 0 and batcher.kv is not None and batcher.kv.in_use == 0


def test_logits_from_a_kept_prefix_equal_a_full_recomputation():
    model = tiny("qwen2", 101)
    decoder = BatchDecoder(model)
    first, second = prompts(24, 10, 7)
    store = SessionStore(SessionLimits(server_memory_bytes=10**9))
    prefix = PrefixCache(lambda n: store.reserve(None, n, transient=True), 100, least=4)
    row = Row(first, GREEDY, keep_prompt=True)
    decoder.prefill(row)
    assert row.kept is not None
    prefix.keep("s", first, row.kept)
    started = prefix.start("s", second, len(second) - 1)
    assert started is not None and started[1] == 24
    cached = Row(second, GREEDY)
    cached.prompt_cache, cached.fed = started
    whole = Row(second, GREEDY)
    torch.testing.assert_close(decoder.prefill(cached), decoder.prefill(whole), rtol=0, atol=1e-5)
    assert cached.keys is not None and whole.keys is not None
    torch.testing.assert_close(cached.keys[:, :, : len(second)], whole.keys[:, :, : len(second)], rtol=0, atol=1e-5)
    assert prefix.start("s", second, 3) is None  # fewer than `least` may be taken


def test_scopes_never_share_and_no_scope_keeps_nothing():
    model = tiny("llama", 101)
    first, second = prompts(20, 9, 14)
    batcher, store, prefix = prefix_batcher(model, 10**9)
    asyncio.run(ask(batcher, first, "a"))
    asyncio.run(ask(batcher, second, "b"))
    asyncio.run(ask(batcher, second, None))
    assert prefix.hits == 0 and prefix.tokens == len(first) + len(second)
    assert prefix.clear() and store.reserved_bytes == 0 and not prefix.clear()


def test_the_cache_keeps_its_bound_least_recently_used_out_first():
    model = tiny("llama", 101)
    first, second, third = prompts(0, 30, 30, 30)
    batcher, store, prefix = prefix_batcher(model, 10**9, max_tokens=70)
    for scope, prompt in zip("abc", (first, second, third), strict=True):
        asyncio.run(ask(batcher, prompt, scope))
    assert prefix.tokens == 60  # a went when c came
    asyncio.run(ask(batcher, list(range(80)), "d"))  # longer than the bound: not kept, and d had nothing
    assert prefix.tokens == 60 and store.reserved_bytes == 60 * bytes_per_token(BatchDecoder(model))


@pytest.mark.parametrize("waiting", [False, True])
def test_kept_prefixes_give_their_memory_to_answers(waiting):
    """The kept prompts fill the server's memory; the next answer (a new one waiting for its prompt's
    blocks, or a running one that must grow) gets it back from the cache rather than waiting or
    being preempted, and answers as alone."""
    model, tokenizer = tiny("llama", 101), ByteTokenizer()
    per_token = bytes_per_token(BatchDecoder(model))
    first, second, third = prompts(0, 40, 40, 20)
    batcher, store, prefix = prefix_batcher(model, 200 * per_token)
    asyncio.run(ask(batcher, first, "a"))
    asyncio.run(ask(batcher, second, "b"))
    assert prefix.tokens == 80
    params = GenerationParams(max_tokens=30 if waiting else 48, temperature=0.0)
    prompt = third + third if waiting else third
    got = asyncio.run(ask(batcher, prompt, "c", params))
    assert same_answer(got, alone(model, tokenizer, prompt, params))
    assert batcher.kv is not None and batcher.kv.preemptions == 0
    assert prefix.start("a", first, 39) is None and prefix.start("b", second, 39) is None
    prefix.clear()
    assert store.reserved_bytes == 0
