"""What training does with a Neurocache adapter that serving never does (engine/memories/neurocache/adapter.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.memories.neurocache.adapter import Neurocache, RetrievalState
from engine.memories.neurocache.state_cache import StateCache


@contextmanager
def training_caches(neurocache: Neurocache, caches: list[StateCache]) -> Iterator[RetrievalState]:
    """`neurocache.attached` for training: caches keep H, and retrieved H is re-projected with
    gradients so that W_p learns through the cache attention."""
    with neurocache.attached(caches) as shared:
        shared.reencode = True
        try:
            yield shared
        finally:
            shared.reencode, shared.hidden = False, None


def new_training_cache(neurocache: Neurocache, capacity: int) -> StateCache:
    """A cache that keeps each entry's hidden state H beside its compressed key (for re-projection)."""
    weight = next(neurocache.projection.parameters())
    hidden = neurocache.model[0].config.hidden_size
    return StateCache(capacity=capacity, dim=neurocache.compressed_dim, device=weight.device, value_dim=hidden)


def merge_lora(neurocache: Neurocache) -> None:
    """Fold each LoRA update into its base weight; the adapter can no longer train. The merged
    weights apply outside a binding too, so a model that also serves `truncate` or `text` sessions
    must not be merged (serving never merges: it uses each LoRALinear's own merged copy, which
    applies inside a binding only)."""
    with torch.no_grad():
        for lora in neurocache.loras().values():
            lora.base.weight += lora.delta().to(lora.base.weight.dtype)
            lora.lora_b.weight.zero_()
