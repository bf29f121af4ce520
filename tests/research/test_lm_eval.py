"""Sliding-window and fed scoring agree where both see the same context."""

from __future__ import annotations

import numpy as np
import torch

from research.lms import build
from research.training.lm_eval import fed_losses, sliding_losses


def test_both_score_every_byte_and_agree_inside_the_first_window():
    torch.manual_seed(0)
    model = build(
        "cacheformer",
        vocab_size=256,
        dim=16,
        n_layers=2,
        n_heads=2,
        max_seq_len=64,
        window=8,
        segment_len=4,
        compressed_per_segment=2,
        group_size=4,
        overlap=True,
        cache_top_k=2,
    ).eval()
    data = np.random.default_rng(0).integers(0, 256, 300).astype(np.uint8)
    sliding = sliding_losses(model, data, 64)
    fed, seconds, nbytes = fed_losses(model, data, chunk=50)
    assert sliding.shape == fed.shape == (299,) and len(seconds) == 6 and nbytes > 0
    np.testing.assert_allclose(fed[:64], sliding[:64], rtol=1e-4, atol=1e-5)  # same context: the same bytes
    assert np.abs(fed[64:] - sliding[64:]).max() > 1e-3  # beyond it the fed history differs
