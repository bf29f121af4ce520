"""How a from-scratch LM is fed a session's text, a piece at a time, for the `state` memory.

- long-short, cacheformer: `SegmentFeed`, the model's whole past as its own state (segment_feed.py):
  compressed segments for every position, the uncompressed ones cache attention fetches.
- segment-cache: `SegmentCacheFeed`, its bounded state (memory and cache, segment_cache_stream.py);
  the logits equal one pass over the whole text, however long.
- transformer, Perceiver AR (all variants), LLP: `WindowFeed`, the last `max_seq_len` tokens, the
  model run over them for each logit asked for. These models have no state that reaches further:
  what they were trained on is one window, so a longer text is read through its last window.

Every feeder's `feed` returns the logits after the last token fed, and `mark`/`rollback` undo what
was fed since the mark (answers are fed, then forgotten). Marks are undone newest first: the
segment feed writes its buffers in place past the marked row counts; the others replace their
tensors, so a mark's references keep their values. The session's write lock orders them.

LLP's half-segments are counted from the window's first token, so past `max_seq_len` they shift by
one position at each token; the logits there are the model's on that window, not on the whole text.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch

from research.lms.lm_common import LanguageModel
from research.lms.perceiver_ar import VARIANTS as PERCEIVERS
from research.lms.segment_cache import SegmentCacheLM
from research.lms.segment_cache_stream import SegmentCacheStream
from research.lms.segment_feed import CHUNK, FeedState, check_feedable, feed

WINDOW_ARCHS = ("transformer", *PERCEIVERS, "llp")


class Feeder(Protocol):
    @property
    def length(self) -> int: ...  # tokens fed in all
    @property
    def nbytes(self) -> int: ...
    def feed(self, token_ids: list[int]) -> torch.Tensor: ...  # the next token's logits [V]
    def reserve(self, tokens: int) -> None: ...  # room for feeding `tokens` more in pieces, made at once
    def trim(self) -> None: ...  # give back the room past what the state holds
    def mark(self) -> Any: ...
    def rollback(self, mark: Any) -> None: ...
    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...
    def bytes_per_token(self) -> int: ...  # what a token adds while the state grows (cache info)
    def growth(self, tokens: int) -> int: ...  # the most feeding `tokens` more can allocate (counted before)
    def reach(self) -> int | None: ...  # the most past tokens the state holds; None: every one
    def answer_room(self) -> int | None: ...  # the most prompt + answer tokens one answer may feed


def _element_bytes(model: LanguageModel) -> int:
    return next(model.parameters()).element_size()


class SegmentFeed:
    def __init__(self, model: LanguageModel) -> None:
        check_feedable(model)
        self.model, self.state = model, FeedState(model)

    @property
    def length(self) -> int:
        return self.state.length

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def feed(self, token_ids: list[int]) -> torch.Tensor:
        return feed(self.model, self.state, token_ids)[-1]

    def mark(self) -> Any:
        return self.state.mark()

    def rollback(self, mark: Any) -> None:
        self.state.rollback(mark)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        device = next(self.model.parameters()).device  # saved sessions are read onto the CPU
        self.state.load_state_dict({name: tensor.to(device) for name, tensor in state.items()})

    def bytes_per_token(self) -> int:
        """Its window key/value, and its share of the compressed segments, in every layer."""
        cfg = self.model.config
        per_layer = (
            2 * cfg.dim * _element_bytes(self.model) * (1 + (1 + cfg.overlap) * cfg.compressed_per_segment / cfg.segment_len)
        )
        return int(per_layer * cfg.n_layers + 0.5)

    def reserve(self, tokens: int) -> None:
        self.state.reserve(tokens)

    def trim(self) -> None:
        self.state.trim()

    def growth(self, tokens: int) -> int:
        """The stores' new room when they must grow (each copied once into a buffer of its new
        size, the old one freed after), and the raw keys/values of the unfinished segments: a
        chunk of rows appended to a tail of under two segments, copied beside the old tail."""
        if not tokens:
            return 0
        cfg = self.model.config
        row = 2 * cfg.dim * _element_bytes(self.model) * cfg.n_layers
        return self.state.reserve_bytes(tokens) + row * (2 * cfg.segment_len + min(tokens, CHUNK))

    def reach(self) -> int | None:
        return None

    def answer_room(self) -> int | None:
        return None


class SegmentCacheFeed(SegmentCacheStream):
    """The stream, its `feed` returning only the last token's logits."""

    def feed(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        return super().feed(token_ids)[-1]

    def reserve(self, tokens: int) -> None:
        pass  # its stores are bounded; each feed copies them (counted in growth)

    def trim(self) -> None:
        pass  # it holds no room

    def bytes_per_token(self) -> int:
        """A key and a value in both passes of every layer, and a segment key (a feed of a few
        tokens can end a segment)."""
        cfg, size = self.model.config, _element_bytes(self.model)
        return (2 * 2 * cfg.n_layers + 1) * cfg.dim * size

    def growth(self, tokens: int) -> int:
        """A whole new state: a feed copies every store (torch.cat), and a mark keeps the old ones
        (already counted) until it is dropped."""
        cfg, size = self.model.config, _element_bytes(self.model)
        cached, query = self.bound_tokens()
        keys = cfg.memory_len // cfg.segment_len + cfg.cache_segments + 1
        return 2 * cfg.n_layers * cfg.dim * size * (cached + query) + keys * cfg.dim * size if tokens else 0

    def reach(self) -> int | None:
        cfg = self.model.config
        return cfg.memory_len + cfg.cache_segments * cfg.segment_len

    def answer_room(self) -> int | None:
        return None  # the stream takes any length; a long question pushes the document out of reach


class WindowFeed:
    def __init__(self, model: LanguageModel) -> None:
        self.model, self.length = model, 0
        self.window = torch.zeros(0, dtype=torch.long, device=next(model.parameters()).device)

    @property
    def nbytes(self) -> int:
        return self.window.nbytes

    @torch.inference_mode()
    def feed(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.window.device).view(-1)
        self.window = torch.cat([self.window, ids])[-self.model.config.max_seq_len :].clone()  # no long feed kept alive
        self.length += len(ids)
        return self.model(self.window[None])[0, -1]

    def reserve(self, tokens: int) -> None:
        pass  # the window is bounded; each feed copies it (counted in growth)

    def trim(self) -> None:
        pass  # it holds no room

    def mark(self) -> Any:
        return self.window, self.length

    def rollback(self, mark: Any) -> None:
        self.window, self.length = mark

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"window": self.window, "length": torch.tensor(self.length)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.window, self.length = state["window"].to(self.window.device), int(state["length"])

    def bytes_per_token(self) -> int:
        return self.window.element_size()

    def growth(self, tokens: int) -> int:
        return min(tokens, self.model.config.max_seq_len) * self.window.element_size()

    def reach(self) -> int | None:
        return self.model.config.max_seq_len

    def answer_room(self) -> int | None:
        return self.model.config.max_seq_len  # a longer question and answer would push out the question


def feeder_for(model: LanguageModel) -> Feeder:
    """The feeder of `model`'s family; a ValueError for a family none feeds."""
    if model.arch in ("long-short", "cacheformer"):
        return SegmentFeed(model)
    if model.arch == "segment-cache":
        return SegmentCacheFeed(cast(SegmentCacheLM, model))
    if model.arch in WINDOW_ARCHS:
        return WindowFeed(model)
    raise ValueError(f"no feeder for a {model.arch!r} model")
