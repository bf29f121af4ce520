"""Neurocache's state cache: exact retrieval, neighbour windows, boundaries, wrap-around, save/restore."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from engine.memories.neurocache.knn import FaissCpuKnn, TorchKnn
from engine.memories.neurocache.state_cache import StateCache

BACKENDS = [FaissCpuKnn(), TorchKnn()]


def brute_force(database: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    distances = ((queries[:, None, :] - database[None, :, :]) ** 2).sum(-1)
    return np.argsort(distances, axis=1, kind="stable")[:, :k]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_retrieval_equals_numpy_brute_force(backend):
    torch.manual_seed(0)
    cache = StateCache(capacity=500, dim=16, backend=backend)
    states = torch.nn.functional.normalize(torch.randn(400, 16), dim=-1)
    cache.add(states, document=0)
    queries = torch.randn(32, 16)
    got = cache.search(queries, k=8)
    expected = brute_force(states.cpu().numpy(), queries.cpu().numpy(), 8)
    np.testing.assert_allclose(got.states.cpu().numpy(), states.cpu().numpy()[expected], rtol=0, atol=0)
    assert got.mask.all()


def test_backends_agree_on_indices():
    torch.manual_seed(1)
    db, queries = torch.randn(1000, 32), torch.randn(64, 32)
    _, faiss_rows = FaissCpuKnn().search(db, queries, 16)
    _, torch_rows = TorchKnn().search(db, queries, 16)
    assert (faiss_rows == torch_rows).float().mean() > 0.99  # ties aside, the same neighbours


@pytest.mark.parametrize("n_queries", [5, 40], ids=["scanned", "widened-in-blocks"])
@pytest.mark.parametrize("capacity", [120, 100], ids=["partly-filled", "full"])
def test_bfloat16_cache_search_equals_brute_force_over_its_stored_values(capacity, n_queries):
    """A bfloat16 cache lives in a FAISS scalar-quantizer index and is searched exactly over the
    values it holds, its valid rows only: scanned in place for a few queries, widened to float32
    in blocks (here of 7 rows) whose top-k are merged for many."""
    torch.manual_seed(3)
    cache = StateCache(capacity=capacity, dim=16, dtype=torch.bfloat16, backend=FaissCpuKnn(block_rows=7, batch_queries=32))
    cache.add(torch.nn.functional.normalize(torch.randn(100, 16), dim=-1), document=0)
    stored = cache.states[:100].float().cpu()
    queries = torch.randn(n_queries, 16).cpu()
    got = cache.search(queries, k=9)
    expected = brute_force(stored.cpu().numpy(), queries.cpu().numpy(), 9)
    assert got.states.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.states.float().cpu().numpy(), stored.cpu().numpy()[expected])
    distances, _ = cache.nearest(queries, 9)
    reference = ((queries[:, None, :] - stored[None]) ** 2).sum(-1).sort(dim=1).values[:, :9]
    # FAISS's AVX-512 scanner (seen on the GPU machine's CPU) returns these distances at about
    # bfloat16 precision (0.4% off); the neighbours above are exact on every CPU
    torch.testing.assert_close(distances, reference, rtol=2**-7, atol=1e-3)
    assert cache.nbytes == capacity * 16 * 2 + 2 * capacity * 8


def test_bfloat16_rows_in_the_faiss_index_follow_every_write():
    """Overwrites after a wrap-around, rollback, reset and load all reach what FAISS scans."""
    torch.manual_seed(5)
    cache = StateCache(capacity=8, dim=4, dtype=torch.bfloat16)
    cache.add(marked(8), document=0)
    cache.begin()
    cache.add(marked(3, start=100), document=0)  # overwrites slots 0-2
    assert first_coords(cache.search(marked(1, start=101), k=1)) == [101.0]
    cache.rollback()
    assert first_coords(cache.search(marked(1, start=101), k=1)) == [7.0]
    cache.reset()
    cache.add(marked(2, start=50), document=0)
    assert first_coords(cache.search(marked(1, start=0), k=2)) == [50.0, 51.0]  # only the 2 valid rows


def test_bfloat16_rows_outlive_their_cache():
    """A view of the rows keeps the FAISS index that owns their memory alive."""
    cache = StateCache(capacity=4, dim=4, dtype=torch.bfloat16)
    cache.add(marked(4, start=10), document=0)
    rows = cache.states[1:3]
    del cache
    gc.collect()
    torch.empty(1_000_000).fill_(7.0)  # would reuse freed memory
    assert rows[:, 0].float().tolist() == [11.0, 12.0]


def marked(n: int, start: int = 0, dim: int = 4) -> torch.Tensor:
    """States whose first coordinate is their write order, so retrieval is easy to read."""
    states = torch.zeros(n, dim)
    states[:, 0] = torch.arange(start, start + n, dtype=torch.float32)
    return states


def first_coords(retrieved, row: int = 0) -> list[float | None]:
    return [float(s[0]) if m else None for s, m in zip(retrieved.states[row], retrieved.mask[row], strict=True)]


def test_window_takes_the_next_states_in_write_order():
    cache = StateCache(capacity=100, dim=4)
    cache.add(marked(10), document=0)
    got = cache.search(marked(1, start=3), k=1, window=3)
    assert first_coords(got) == [3.0, 4.0, 5.0]


def test_window_never_crosses_a_document_boundary():
    cache = StateCache(capacity=100, dim=4)
    cache.add(marked(5), document=0)
    cache.add(marked(5, start=5), document=1)
    got = cache.search(marked(1, start=4), k=1, window=3)
    assert first_coords(got) == [4.0, None, None]


def test_window_stops_at_the_newest_state():
    cache = StateCache(capacity=100, dim=4)
    cache.add(marked(6), document=0)
    assert first_coords(cache.search(marked(1, start=5), k=1, window=2)) == [5.0, None]


def test_fifo_eviction_and_wrap_around():
    cache = StateCache(capacity=8, dim=4)
    cache.add(marked(6), document=0)
    cache.add(marked(6, start=6), document=0)  # counters 6..11 overwrite slots of 0..3
    assert cache.size == 8 and cache.written == 12
    resident = sorted(float(x) for x in cache.states[:, 0])
    assert resident == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    # the match at 7 sits in slot 7; its neighbour 8 wrapped into slot 0 and is found by counter
    assert first_coords(cache.search(marked(1, start=7), k=1, window=3)) == [7.0, 8.0, 9.0]
    # the newest state's neighbour slot holds an old counter: masked, not returned
    assert first_coords(cache.search(marked(1, start=11), k=1, window=2)) == [11.0, None]


def test_neighbour_overwritten_after_wrap_is_masked():
    cache = StateCache(capacity=4, dim=4)
    cache.add(marked(4), document=0)
    cache.add(marked(1, start=4), document=0)  # counter 4 overwrites slot 0 (counter 0)
    got = cache.search(marked(1, start=3), k=1, window=2)
    assert first_coords(got) == [3.0, 4.0]  # 4 is the true next state, now in slot 0
    cache2 = StateCache(capacity=4, dim=4)
    cache2.add(marked(4), document=0)
    cache2.add(marked(4, start=4), document=1)
    assert first_coords(cache2.search(marked(1, start=7), k=1, window=2)) == [7.0, None]


def test_empty_and_partly_filled_caches_mask_what_is_missing():
    cache = StateCache(capacity=16, dim=4)
    assert not cache.search(torch.zeros(2, 4), k=4, window=2).mask.any()
    cache.add(marked(2), document=0)
    got = cache.search(marked(1), k=4, window=1)
    assert got.mask[0].tolist() == [True, True, False, False]
    assert (got.states[0, 2:] == 0).all()


def test_more_states_than_capacity_in_one_add_keeps_the_newest():
    cache = StateCache(capacity=4, dim=4)
    cache.add(marked(10), document=0)
    assert sorted(float(x) for x in cache.states[:, 0]) == [6.0, 7.0, 8.0, 9.0] and cache.written == 10


def test_save_and_restore_bit_for_bit(tmp_path):
    torch.manual_seed(2)
    cache = StateCache(capacity=64, dim=8, dtype=torch.bfloat16)
    cache.add(torch.randn(50, 8), document=0)
    cache.add(torch.randn(30, 8), document=1)
    cache.save(tmp_path / "c")
    restored = StateCache.load(tmp_path / "c")
    assert restored.written == cache.written and restored.dtype == torch.bfloat16
    for name in ("states", "slot_counter", "slot_document"):
        assert torch.equal(getattr(restored, name), getattr(cache, name))
    queries = torch.randn(5, 8)
    a, b = cache.search(queries, k=4, window=2), restored.search(queries, k=4, window=2)
    assert torch.equal(a.states, b.states) and torch.equal(a.mask, b.mask)


def test_reset_and_bad_input():
    cache = StateCache(capacity=8, dim=4)
    cache.add(marked(3), document=0)
    cache.reset()
    assert cache.size == 0 and not cache.search(marked(1), k=2).mask.any()
    with pytest.raises(ValueError, match="dim"):
        cache.add(torch.zeros(2, 5), document=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_cache_matches_cpu():
    torch.manual_seed(3)
    states, queries = torch.randn(300, 16), torch.randn(20, 16)
    cpu = StateCache(capacity=256, dim=16)
    gpu = StateCache(capacity=256, dim=16, device="cuda")
    cpu.add(states, document=0)
    gpu.add(states.cuda(), document=0)
    a, b = cpu.search(queries, k=8, window=2), gpu.search(queries.cuda(), k=8, window=2)
    torch.testing.assert_close(b.states.cpu(), a.states)
    assert torch.equal(b.mask.cpu(), a.mask)


def test_rollback_restores_everything_even_after_wrap_around():
    torch.manual_seed(4)
    cache = StateCache(capacity=16, dim=4)
    cache.add(torch.randn(12, 4), document=0)
    before = (cache.states.clone(), cache.slot_counter.clone(), cache.slot_document.clone(), cache.written)
    cache.begin()
    cache.add(torch.randn(10, 4), document=1)  # wraps and overwrites 6 old states
    cache.add(torch.randn(30, 4), document=1)  # more than the capacity in one add
    cache.rollback()
    assert torch.equal(cache.states, before[0]) and torch.equal(cache.slot_counter, before[1])
    assert torch.equal(cache.slot_document, before[2]) and cache.written == before[3]
    cache.begin()
    cache.add(torch.randn(3, 4), document=2)
    cache.commit()
    cache.rollback()  # nothing to undo after a commit
    assert cache.written == 15
