"""The from-scratch LMs (transformer, Long-Short, CacheFormer), built by name."""

from __future__ import annotations

from typing import Any

from research.lms.lm_common import LanguageModel, LMConfig

ARCHS = ("transformer", "long-short", "cacheformer")


def build(arch: str, **config: Any) -> LanguageModel:
    """A from-scratch language model: `forward(input_ids [B, T]) -> logits [B, T, V]`.

    `long-short` is CacheFormer with overlap and cache attention off; asking it for either is an error.
    """
    from research.lms.cacheformer import build_cacheformer
    from research.lms.long_short import build_long_short
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
    raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")


__all__ = ["ARCHS", "LMConfig", "LanguageModel", "build"]
