"""Long-context evaluation of the from-scratch LMs: does a history fed beyond the training
length help, against a sliding window of the training length? Both score every byte after the
first and return per-byte losses (nats), so they can be compared position by position."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from research.lms.lm_common import LanguageModel
from research.lms.segment_feed import FeedState, feed


@torch.inference_mode()
def sliding_losses(model: LanguageModel, data: np.ndarray, context: int) -> np.ndarray:
    """Each byte scored with at least context/2 (at most `context`) bytes before it: windows of
    `context` bytes every context/2, each scoring its second half (the first window all of it)."""
    device = next(model.parameters()).device
    ids = torch.from_numpy(data.astype(np.int64)).to(device)
    half, losses = context // 2, []
    for start in range(0, len(ids) - 1, half):
        window = ids[start : start + context + 1]
        logits = model(window[None, :-1])[0]
        skip = 0 if start == 0 else half
        losses.append(F.cross_entropy(logits[skip:].float(), window[skip + 1 :], reduction="none"))
        if start + context + 1 >= len(ids):
            break
    return torch.cat(losses).cpu().numpy()


@torch.inference_mode()
def fed_losses(model: LanguageModel, data: np.ndarray, chunk: int = 1024) -> tuple[np.ndarray, list[float], int]:
    """Each byte scored with the whole text before it, fed through the model's segment state.

    Returns the losses, the seconds elapsed after each chunk, and the state's bytes at the end.
    """
    device = next(model.parameters()).device
    ids = torch.from_numpy(data.astype(np.int64)).to(device)
    state, losses, seconds = FeedState(model), [], []
    started = time.perf_counter()
    state.reserve(len(ids) - 1)  # as the state memory does for a document: the chunks then copy nothing
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : start + chunk + 1]
        logits = feed(model, state, piece[:-1])
        losses.append(F.cross_entropy(logits.float(), piece[1:], reduction="none"))
        seconds.append(time.perf_counter() - started)
    return torch.cat(losses).cpu().numpy(), seconds, state.nbytes
