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
    name = "faiss-cpu"

    def search(self, database: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        xb = np.ascontiguousarray(database.detach().float().cpu().numpy())
        xq = np.ascontiguousarray(queries.detach().float().cpu().numpy())
        distances, rows = faiss.knn(xq, xb, k)
        return torch.from_numpy(distances).to(queries.device), torch.from_numpy(rows).to(queries.device)


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
