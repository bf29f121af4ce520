"""Exact k-nearest-neighbour search (L2) behind one interface, chosen by device.

Brute force is the right default at session-cache sizes (DESIGN.md): FAISS on CPU, FAISS GPU when
the installed faiss has GPU support, else a torch matmul + top-k on CUDA.
"""

from __future__ import annotations

from typing import Protocol

import faiss
import numpy as np
import torch


class KnnBackend(Protocol):
    name: str

    def search(self, database: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Squared L2 distances and row indices of the k nearest rows of `database` [n, d] for each
        query [q, d]; both [q, k], nearest first, on the queries' device. Requires 1 <= k <= n."""
        ...


class FaissCpuKnn:
    """FAISS brute force. A float32 database is searched in place; any other dtype (a bfloat16
    cache) is widened to float32 one block of rows at a time, and the blocks' top-k are merged,
    so a search never holds a float32 copy of the whole cache."""

    name = "faiss-cpu"

    def __init__(self, block_rows: int = 65_536) -> None:
        self.block_rows = block_rows

    def search(self, database: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        xq = np.ascontiguousarray(queries.detach().float().cpu().numpy())
        database = database.detach().cpu()
        if database.dtype == torch.float32 or database.shape[0] <= self.block_rows:
            distances, rows = faiss.knn(xq, np.ascontiguousarray(database.float().numpy()), k)
        else:
            distances, rows = self._blocked(database, xq, k)
        return torch.from_numpy(distances).to(queries.device), torch.from_numpy(rows).to(queries.device)

    def _blocked(self, database: torch.Tensor, xq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        parts_d, parts_i = [], []
        for start in range(0, database.shape[0], self.block_rows):
            block = np.ascontiguousarray(database[start : start + self.block_rows].float().numpy())
            d, i = faiss.knn(xq, block, min(k, block.shape[0]))
            parts_d.append(d)
            parts_i.append(i + start)
        distances, rows = np.concatenate(parts_d, axis=1), np.concatenate(parts_i, axis=1)
        order = np.argsort(distances, axis=1, kind="stable")[:, :k]  # ties keep the lower row first
        return np.take_along_axis(distances, order, 1), np.take_along_axis(rows, order, 1)


class FaissGpuKnn:
    name = "faiss-gpu"

    def __init__(self) -> None:
        self._resources = faiss.StandardGpuResources()

    def search(self, database: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        xb = np.ascontiguousarray(database.detach().float().cpu().numpy())
        xq = np.ascontiguousarray(queries.detach().float().cpu().numpy())
        distances, rows = faiss.knn_gpu(self._resources, xq, xb, k)
        return torch.from_numpy(distances).to(queries.device), torch.from_numpy(rows).to(queries.device)


class TorchKnn:
    """||q - x||^2 = ||q||^2 - 2 q.x + ||x||^2 as one matmul, in float32, on the tensors' device."""

    name = "torch"

    def search(self, database: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        xb, xq = database.float(), queries.float()
        distances = (xq * xq).sum(-1, keepdim=True) - 2.0 * xq @ xb.T + (xb * xb).sum(-1)  # q, n
        top, rows = torch.topk(distances, k, dim=-1, largest=False)
        return top.clamp_min(0.0), rows


def faiss_has_gpu() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def backend_for(device: torch.device | str) -> KnnBackend:
    """FAISS on CPU; on CUDA, FAISS GPU where the installed faiss has it, else torch."""
    if torch.device(device).type != "cuda":
        return FaissCpuKnn()
    return FaissGpuKnn() if faiss_has_gpu() else TorchKnn()
