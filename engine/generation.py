"""Token-by-token generation on a Hugging Face causal LM: sampling, stop strings, incremental text."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from engine.interface import GenerationDone, GenerationParams, TokenDelta

# Temperatures below this sample as greedy: logits / 1e-300 overflow, and below ~1e-5 the
# softmax is one-hot in float32 anyway (vLLM uses the same cut-off).
GREEDY_BELOW_TEMPERATURE = 1e-5


def sample_next(logits: torch.Tensor, params: GenerationParams, generator: torch.Generator | None) -> int:
    """Pick the next token from float logits [V]: greedy at temperature 0 (or below
    GREEDY_BELOW_TEMPERATURE), else nucleus sampling. The most likely token always survives top-p,
    however small top_p is."""
    if params.temperature < GREEDY_BELOW_TEMPERATURE:
        return int(torch.argmax(logits))
    logits = logits.float()
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
        drop = before >= params.top_p
        drop[0] = False  # a top_p that rounds to 0 in float32 must not mask every token
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@functools.lru_cache(maxsize=8)
def word_tokens(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """bool [vocabulary]: tokens holding a letter. Only these may be banned by the n-gram guard:
    numbers are spelt a digit a token by many tokenizers (SmolLM2's "1,000,000" is 1 , 0 0 0 , 0 0 0),
    so banning a repeated digit n-gram would make such numbers impossible to write."""
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else int(tokenizer.vocab_size)
    if hasattr(tokenizer, "convert_ids_to_tokens"):  # Hugging Face: one call for the whole vocabulary
        texts = [tokenizer.convert_tokens_to_string([p]) for p in tokenizer.convert_ids_to_tokens(list(range(size)))]
    else:  # engine/models/byte_tokenizer.py: a byte a token
        texts = [tokenizer.decode([i]) for i in range(size)]
    return torch.tensor([any(c.isalpha() for c in text) for text in texts], dtype=torch.bool)


class RepetitionGuard:
    """Keeps an answer from looping: bans the word token that would repeat an n-gram the answer
    already holds (no_repeat_ngram_size; digits and punctuation are never banned) and divides
    positive logits of tokens it already holds by the penalty (negative ones multiplied), as
    Hugging Face does. Only the answer's own tokens count. Each step costs the same however long
    the answer is."""

    def __init__(self, params: GenerationParams, bannable: torch.Tensor | None = None) -> None:
        self.n, self.penalty = params.no_repeat_ngram_size, params.repetition_penalty
        self.bannable = bannable  # bool [vocabulary]; None: every token
        self.answer: list[int] = []
        self._next: dict[tuple[int, ...], set[int]] = {}  # (n-1)-token prefix -> tokens that followed it

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.penalty != 1.0 and self.answer:
            seen = torch.tensor(sorted(set(self.answer)), dtype=torch.long)
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / self.penalty, values * self.penalty)
        if self.n and len(self.answer) >= self.n - 1:
            banned = [t for t in self._next.get(tuple(self.answer[len(self.answer) - self.n + 1 :]), ()) if self._may_ban(t)]
            if banned and len(banned) < logits.numel():
                logits[torch.tensor(sorted(banned), dtype=torch.long)] = float("-inf")
        return logits

    def _may_ban(self, token: int) -> bool:
        return self.bannable is None or token >= len(self.bannable) or bool(self.bannable[token])

    def add(self, token: int) -> None:
        self.answer.append(token)
        if self.n and len(self.answer) >= self.n:
            gram = self.answer[-self.n :]
            self._next.setdefault(tuple(gram[:-1]), set()).add(gram[-1])


class TextAssembler:
    """Turns generated token ids into text deltas, holding back what may still change.

    Held back: an incomplete UTF-8 character, and any tail that could be the start of a stop string.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._emitted = 0
        self.stopped = False

    def _text(self) -> str:
        return self._tokenizer.decode(self._ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._text()
        if text.endswith("\ufffd"):
            return ""
        for stop in self._stop:
            at = text.find(stop, max(0, self._emitted - len(stop)))
            if at != -1:
                self.stopped = True
                return self._take(text[:at])
        return self._take(text[: len(text) - self._held_tail(text)])

    def flush(self) -> str:
        return "" if self.stopped else self._take(self._text())

    def _held_tail(self, text: str) -> int:
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    longest = max(longest, n)
                    break
        return longest

    def _take(self, upto: str) -> str:
        delta = upto[self._emitted :]
        self._emitted = max(self._emitted, len(upto))
        return delta


@dataclass(frozen=True)
class StopTokens:
    ids: frozenset[int]

    @classmethod
    def of(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> StopTokens:
        ids: set[int] = set()
        for source in (getattr(model, "generation_config", None), tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
            ids.add(im_end)
        return cls(frozenset(ids))


@torch.inference_mode()
def generate_steps(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[int],
    params: GenerationParams,
    stop_tokens: StopTokens,
    step_context: Callable[[], AbstractContextManager[object]] | None = None,
) -> Iterator[TokenDelta | GenerationDone]:
    """`decode_steps` on a Hugging Face model: its own KV cache carries state between steps, so
    each step costs one token. `step_context` wraps every forward pass (a Neurocache session
    attaches its cache with it)."""
    cache = DynamicCache()
    device = model.device

    def forward(ids: list[int]) -> torch.Tensor:
        with step_context() if step_context is not None else nullcontext():
            out = model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    yield from decode_steps(forward, tokenizer, prompt_ids, params, stop_tokens)


@torch.inference_mode()
def decode_steps(
    forward: Callable[[list[int]], torch.Tensor],
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[int],
    params: GenerationParams,
    stop_tokens: StopTokens,
) -> Iterator[TokenDelta | GenerationDone]:
    """A blocking generator: prefill, then one decode step per `next()`, yielding text deltas.

    `forward(ids)` runs `ids` after everything it was given before and returns the last position's
    logits [V]; it owns whatever state carries between calls.
    """
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    assembler = TextAssembler(tokenizer, params.stop)
    guard = RepetitionGuard(params, word_tokens(tokenizer) if params.no_repeat_ngram_size else None)
    ids = list(prompt_ids)
    ttft = 0.0
    finish_reason = "length"
    produced = 0
    for produced in range(1, params.max_tokens + 1):
        token = sample_next(guard.apply(forward(ids).float().cpu()), params, generator)
        guard.add(token)
        if produced == 1:
            ttft = time.perf_counter() - started
        if token in stop_tokens.ids:
            finish_reason = "stop"
            break
        delta = assembler.add(token)
        if delta:
            yield TokenDelta(delta)
        if assembler.stopped:
            finish_reason = "stop"
            break
        if params.max_seconds is not None and time.perf_counter() - started > params.max_seconds:
            break  # finish_reason stays "length": a time cap ends an answer as max_tokens does
        ids = [token]
    tail = assembler.flush()
    if tail:
        yield TokenDelta(tail)
    yield GenerationDone(
        finish_reason=finish_reason,
        prompt_tokens=len(prompt_ids),
        completion_tokens=produced,
        ttft_seconds=ttft,
        total_seconds=time.perf_counter() - started,
    )
