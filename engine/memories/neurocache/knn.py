"""Exact k-nearest-neighbour search (L2) behind one interface, chosen by device.

Exact brute force is the default at session-cache sizes: HNSW cannot delete entries and IVF needs
training, while one scan is fast enough (100k x 256 float32 rows, 2048 queries, k=16: about 0.6 s
on 2 CPU cores). FAISS on CPU, FAISS GPU when the installed faiss has GPU support, else a torch
matmul + top-k on CUDA.

A backend also allocates the rows it will search (`allocate`), so that FAISS on CPU can keep a
bfloat16 cache inside a flat scalar-quantizer index and scan it in place: widening 2-byte rows to
float32 before every lookup would cost more than the lookup itself.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import faiss
import numpy as np
import torch


class SearchableRows(Protocol):
    rows: torch.Tensor  # capacity, d: written in place by the cache

    def search(self, queries: torch.Tensor, k: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`KnnBackend.search` over the first `valid` rows."""
        ...


class KnnBackend(Protocol):
    name: str

    def search(self, database: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Squared L2 distances and row indices of the k nearest rows of `database` [n, d] for each
        query [q, d]; both [q, k], nearest first, on the queries' device. Requires 1 <= k <= n."""
        ...

    def allocate(self, capacity: int, dim: int, dtype: torch.dtype, device: torch.device) -> SearchableRows:
        """Zeroed rows [capacity, dim] this backend searches."""
        ...


class PlainRows:
    """A tensor of rows, searched by handing its valid prefix to the backend (no copy for float32)."""

    def __init__(self, backend: KnnBackend, capacity: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.backend = backend
        self.rows = torch.zeros(capacity, dim, dtype=dtype, device=device)

    def search(self, queries: torch.Tensor, k: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.search(self.rows[:valid], queries, k)


class FaissBfloat16Rows:
    """bfloat16 rows whose memory is the code array of a FAISS flat scalar-quantizer index
    (QT_bf16, L2). For a few queries (decoding) FAISS scans the rows in place, decoding each as it
    goes; bfloat16 -> float32 is exact, so the search is exact over the stored values and never
    widens the whole matrix. For many queries (a prompt, a segment) one matrix product beats a
    scan per query: the rows are widened to float32 a block at a time and the blocks' top-k merged."""

    def __init__(self, capacity: int, dim: int, *, block_rows: int = 65_536, batch_queries: int = 32) -> None:
        index = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_bf16, faiss.METRIC_L2)
        index.codes.resize(capacity * index.code_size)  # zero bytes: bfloat16 zeros
        index.ntotal = capacity
        nbytes = capacity * index.code_size
        address = faiss.rev_swig_ptr(index.codes.data(), nbytes).ctypes.data
        buffer = (ctypes.c_uint8 * nbytes).from_address(address)
        buffer.owner = index  # type: ignore[attr-defined]  # ctypes arrays take attributes; every view of `rows` keeps the index, and so its memory, alive
        self.index = index
        self.rows = torch.from_numpy(np.ctypeslib.as_array(buffer)).view(torch.bfloat16).view(capacity, dim)
        self.block_rows, self.batch_queries = block_rows, batch_queries

    def search(self, queries: torch.Tensor, k: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
        xq = np.ascontiguousarray(queries.detach().float().cpu().numpy())
        if xq.shape[0] >= self.batch_queries:
            distances, rows = self._widened(xq, k, valid)
        else:
            self.index.ntotal = valid  # scan the valid prefix only
            distances, rows = self.index.search(xq, k)
        return torch.from_numpy(distances).to(queries.device), torch.from_numpy(rows).to(queries.device)

    def _widened(self, xq: np.ndarray, k: int, valid: int) -> tuple[np.ndarray, np.ndarray]:
        parts_d, parts_i = [], []
        for start in range(0, valid, self.block_rows):
            block = self.rows[start : min(start + self.block_rows, valid)].float().numpy()
            d, i = faiss.knn(xq, block, min(k, block.shape[0]))
            parts_d.append(d)
            parts_i.append(i + start)
        distances, rows = np.concatenate(parts_d, axis=1), np.concatenate(parts_i, axis=1)
        order = np.argsort(distances, axis=1, kind="stable")[:, :k]  # ties keep the lower row first
        return np.take_along_axis(distances, order, 1), np.take_along_axis(rows, order, 1)


class FaissCpuKnn:
    """FAISS brute force over float32 rows; bfloat16 rows it allocates live in a scalar-quantizer
    index (FaissBfloat16Rows)."""

    name = "faiss-cpu"

    def __init__(self, *, block_rows: int = 65_536, batch_queries: int = 32) -> None:
        self.block_rows, self.batch_queries = block_rows, batch_queries

    def search(self, database: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        xq = np.ascontiguousarray(queries.detach().float().cpu().numpy())
        xb = np.ascontiguousarray(database.detach().float().cpu().numpy())  # no copy for float32 on CPU
        distances, rows = faiss.knn(xq, xb, k)
        return torch.from_numpy(distances).to(queries.device), torch.from_numpy(rows).to(queries.device)

    def allocate(self, capacity: int, dim: int, dtype: torch.dtype, device: torch.device) -> SearchableRows:
        if dtype == torch.bfloat16 and device.type == "cpu":
            return FaissBfloat16Rows(capacity, dim, block_rows=self.block_rows, batch_queries=self.batch_queries)
        return PlainRows(self, capacity, dim, dtype, device)


class FaissGpuKnn:
    name = "faiss-gpu"

    def __init__(self) -> None:
        self._resources = faiss.StandardGpuResources()

    def search(self, database: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        xb = np.ascontiguousarray(database.detach().float().cpu().numpy())
        xq = np.ascontiguousarray(queries.detach().float().cpu().numpy())
        distances, rows = faiss.knn_gpu(self._resources, xq, xb, k)
        return torch.from_numpy(distances).to(queries.device), torch.from_numpy(rows).to(queries.device)

    def allocate(self, capacity: int, dim: int, dtype: torch.dtype, device: torch.device) -> SearchableRows:
        return PlainRows(self, capacity, dim, dtype, device)


class TorchKnn:
    """||q - x||^2 = ||q||^2 - 2 q.x + ||x||^2 as one matmul, in float32, on the tensors' device."""

    name = "torch"

    def search(self, database: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        xb, xq = database.float(), queries.float()
        distances = (xq * xq).sum(-1, keepdim=True) - 2.0 * xq @ xb.T + (xb * xb).sum(-1)  # q, n
        top, rows = torch.topk(distances, k, dim=-1, largest=False)
        return top.clamp_min(0.0), rows

    def allocate(self, capacity: int, dim: int, dtype: torch.dtype, device: torch.device) -> SearchableRows:
        return PlainRows(self, capacity, dim, dtype, device)


def faiss_has_gpu() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def backend_for(device: torch.device | str) -> KnnBackend:
    """FAISS on CPU; on CUDA, FAISS GPU where the installed faiss has it, else torch."""
    if torch.device(device).type != "cuda":
        return FaissCpuKnn()
    return FaissGpuKnn() if faiss_has_gpu() else TorchKnn()
