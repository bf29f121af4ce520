"""The from-scratch LMs, built by name: transformer, Long-Short, CacheFormer, the segment-selection
key/value cache, Perceiver AR with its V1/V2/V3 enhancements, and LLP."""

from __future__ import annotations

from typing import Any

from research.lms.lm_common import LanguageModel, LMConfig
from research.lms.perceiver_ar import VARIANTS as PERCEIVERS

ARCHS = ("transformer", "long-short", "cacheformer", "segment-cache", *PERCEIVERS, "llp")


def build(arch: str, **config: Any) -> LanguageModel:
    """A from-scratch language model: `forward(input_ids [B, T]) -> logits [B, L, V]` for the last L
    positions (L = T for every family but Perceiver AR, whose L is its latent length).

    `long-short` is CacheFormer with overlap and cache attention off; asking it for either is an error.
    """
    from research.lms.cacheformer import build_cacheformer
    from research.lms.llp import build_llp
    from research.lms.long_short import build_long_short
    from research.lms.perceiver_ar import build_perceiver_ar
    from research.lms.segment_cache import build_segment_cache
    from research.lms.transformer import build_transformer

    lm_config = LMConfig(**config)
    if arch == "transformer":
        return build_transformer(lm_config)
    if arch == "long-short":
        if lm_config.overlap or lm_config.cache_top_k:
            raise ValueError("long-short has no overlap or cache attention; use arch 'cacheformer'")
        return build_long_short(lm_config)
    if arch == "cacheformer":
        return build_cacheformer(lm_config)
    if arch == "segment-cache":
        return build_segment_cache(lm_config)
    if arch in PERCEIVERS:
        return build_perceiver_ar(lm_config, arch)
    if arch == "llp":
        return build_llp(lm_config)
    raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")


__all__ = ["ARCHS", "LMConfig", "LanguageModel", "build"]
