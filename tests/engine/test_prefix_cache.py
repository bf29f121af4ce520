"""A session's next prompt starts from the keys and values of the prefix it shares with its last one
(engine/runtime/prefix_cache.py): the answer is the one the whole prompt gives, the logits equal a
full recomputation's, sessions never share, a deleted session keeps nothing, and what is kept is
reserved from spare memory only and given back, least recently used first, to any other reservation."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch

from engine.config import SessionLimits
from engine.errors import BudgetExceededError
from engine.interface import GenerationParams
from engine.models.llama_step import BatchDecoder, Row
from engine.models.quantize import DECODE_ROWS
from engine.runtime.kv_blocks import KVBlocks
from engine.runtime.prefix_cache import PrefixCache, common_prefix
from engine.runtime.scheduler import Batcher
from engine.runtime.worker import SerialWorker
from engine.sessions.store import SessionStore
from research.lms.byte_tokenizer import ByteTokenizer
from tests.engine.test_batching import NO_STOP, alone, answer_of, same_answer, tiny
from tests.engine.test_kv_blocks import BLOCK, bytes_per_token

GREEDY = GenerationParams(max_tokens=12, temperature=0.0)


@dataclass
class Owner:
    id: str
    deleted: bool = False


A, B, C, D = Owner("a"), Owner("b"), Owner("c"), Owner("d")


def cache_on(store: SessionStore, max_tokens: int = 1000) -> PrefixCache:
    """A prefix cache holding spare memory of `store`, which takes it back as the engine's does."""
    prefix = PrefixCache(lambda n: store.reserve(None, n, transient=True, optional=True), max_tokens, least=4)
    prefix.share_lock(store.books_lock)
    store.reclaimers.append(prefix.reclaim)
    return prefix


def prefix_batcher(model, server_bytes: int, max_tokens: int = 1000) -> tuple[Batcher, SessionStore, PrefixCache]:
    decoder = BatchDecoder(model)
    store = SessionStore(SessionLimits(server_memory_bytes=server_bytes))
    kv = KVBlocks(lambda n: store.reserve(None, n, transient=True), BLOCK, bytes_per_token(decoder), 60.0)
    prefix = cache_on(store, max_tokens)
    worker = SerialWorker("test", 16)
    return Batcher(decoder, worker, cast(Any, ByteTokenizer()), NO_STOP, 8, None, kv, prefix), store, prefix


async def ask(batcher: Batcher, prompt: list[int], owner: Owner | None, params: GenerationParams = GREEDY):
    return answer_of([event async for event in batcher.generate(prompt, params, owner=owner)])


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
        asyncio.run(ask(batcher, first, A)),
        asyncio.run(ask(batcher, second, A)),
        asyncio.run(ask(batcher, third, A, sampled)),
        asyncio.run(ask(batcher, third, A, sampled)),  # all of it kept but the last token
    ]
    want = [
        alone(model, tokenizer, p, q) for p, q in zip([first, second, third, third], [GREEDY] * 2 + [sampled] * 2, strict=True)
    ]
    assert all(same_answer(g, w) for g, w in zip(got, want, strict=True))
    assert prefix.hits == 3 and prefix.reused_tokens == 20 + 20 + len(third) - 1
    assert prefix.tokens == len(third)
    kept = store.reserved_bytes
    assert kept == len(third) * bytes_per_token(BatchDecoder(model))  # float32 model: its own dtype
    prefix.drop("a")
    assert prefix.tokens == 0 and store.reserved_bytes == 0 and batcher.kv is not None and batcher.kv.in_use == 0


def test_logits_from_a_kept_prefix_equal_a_full_recomputation():
    model = tiny("qwen2", 101)
    decoder = BatchDecoder(model)
    first, second = prompts(24, 10, 7)
    prefix = cache_on(SessionStore(SessionLimits(server_memory_bytes=10**9)))
    row = Row(first, GREEDY, keep_prompt=True)
    decoder.prefill(row)
    assert row.kept is not None
    prefix.keep(A, first, row.kept)
    started = prefix.start(A, second, len(second) - 1)
    assert started is not None and started[1] == 24
    cached = Row(second, GREEDY)
    cached.prompt_cache, cached.fed = started
    whole = Row(second, GREEDY)
    torch.testing.assert_close(decoder.prefill(cached), decoder.prefill(whole), rtol=0, atol=1e-5)
    assert cached.keys is not None and whole.keys is not None
    torch.testing.assert_close(cached.keys[:, :, : len(second)], whole.keys[:, :, : len(second)], rtol=0, atol=1e-5)
    assert prefix.start(A, second, 3) is None  # fewer than `least` may be taken


def test_sessions_never_share_and_a_deleted_one_keeps_nothing():
    model = tiny("llama", 101)
    first, second = prompts(20, 9, 14)
    batcher, store, prefix = prefix_batcher(model, 10**9)
    asyncio.run(ask(batcher, first, A))
    asyncio.run(ask(batcher, second, B))
    asyncio.run(ask(batcher, second, None))  # no owner: nothing kept
    assert prefix.hits == 0 and prefix.tokens == len(first) + len(second)
    gone = Owner("e", deleted=True)  # deleted while its answer ran: what it fed is not kept
    asyncio.run(ask(batcher, first, gone))
    assert prefix.tokens == len(first) + len(second) and prefix.start(gone, first, 30) is None
    assert prefix.clear() and store.reserved_bytes == 0 and not prefix.clear()


def test_the_cache_keeps_its_bound_least_recently_used_out_first():
    model = tiny("llama", 101)
    first, second, third = prompts(0, 30, 30, 30)
    batcher, store, prefix = prefix_batcher(model, 10**9, max_tokens=70)
    for owner, prompt in zip((A, B, C), (first, second, third), strict=True):
        asyncio.run(ask(batcher, prompt, owner))
    assert prefix.tokens == 60 and prefix.start(A, first, 29) is None  # a went when c came
    asyncio.run(ask(batcher, list(range(80)), D))  # longer than the bound: not kept, and d had nothing
    assert prefix.tokens == 60 and store.reserved_bytes == 60 * bytes_per_token(BatchDecoder(model))


@pytest.mark.parametrize("waiting", [False, True])
def test_kept_prompts_give_their_memory_to_answers(waiting):
    """The kept prompts fill the server's memory; the next answer (a new one holding its prompt's
    blocks, or a running one that must grow) takes back the least recently used rather than waiting
    or being preempted, and answers as alone."""
    model, tokenizer = tiny("llama", 101), ByteTokenizer()
    per_token = bytes_per_token(BatchDecoder(model))
    first, second, third = prompts(0, 40, 40, 20)
    batcher, store, prefix = prefix_batcher(model, 180 * per_token)
    asyncio.run(ask(batcher, first, A))
    asyncio.run(ask(batcher, second, B))
    assert prefix.tokens == 80
    params = GenerationParams(max_tokens=30 if waiting else 48, temperature=0.0)
    prompt = third * 3 if waiting else third  # 60 tokens: its blocks and cache do not fit beside a and b
    got = asyncio.run(ask(batcher, prompt, C, params))
    assert same_answer(got, alone(model, tokenizer, prompt, params))
    assert batcher.kv is not None and batcher.kv.preemptions == 0
    assert prefix.start(A, first, 39) is None  # the least recently used went first
    prefix.clear()
    assert store.reserved_bytes == 0


def test_a_cache_takes_only_spare_memory():
    store = SessionStore(SessionLimits(server_memory_bytes=100))
    prefix = cache_on(store)
    layers = [(torch.zeros(1, 1, 10, 1), torch.zeros(1, 1, 10, 1))]  # 80 bytes
    assert prefix.keep(A, list(range(10)), layers) and store.reserved_bytes == 80
    assert not prefix.keep(B, list(range(10)), layers)  # no room to spare: A's entry is not taken
    assert prefix.tokens == 10
    with pytest.raises(BudgetExceededError):
        store.reserve(None, 30, transient=True, optional=True)
    held = store.reserve(None, 30, transient=True)  # anything else takes the cache's memory back
    assert prefix.tokens == 0 and store.reserved_bytes == 30
    held.release()


def test_a_part_fed_through_low_precision_weights_is_never_left_short():
    """Where a part of DECODE_ROWS tokens or fewer would run through the int8/int4 copy
    (`whole_tail`), the kept prefix leaves more than that to feed."""
    model, tokenizer = tiny("llama", 101), ByteTokenizer()
    first, second = prompts(30, 5, 5)
    batcher, _, prefix = prefix_batcher(model, 10**9)
    batcher._decoder.whole_tail = True
    asyncio.run(ask(batcher, first, A))
    got = asyncio.run(ask(batcher, second, A))
    assert same_answer(got, alone(model, tokenizer, second, GREEDY))
    assert prefix.reused_tokens == len(second) - DECODE_ROWS - 1 == 18
