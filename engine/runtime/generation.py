"""Token-by-token generation on a Hugging Face causal LM: sampling, stop strings, incremental text."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import cast

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
    else:  # research/lms/byte_tokenizer.py: a byte a token
        texts = [cast(str, tokenizer.decode([i])) for i in range(size)]  # one sequence in, one text out
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
        self._seen: torch.Tensor | None = None  # bool [vocabulary]: tokens the answer holds (for the penalty)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.penalty != 1.0:
            if self._seen is None:
                self._seen = torch.zeros(logits.numel(), dtype=torch.bool, device=logits.device)
                self._seen[[t for t in self.answer if t < logits.numel()]] = True
            penalized = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
            logits = torch.where(self._seen, penalized, logits)
        if self.n and len(self.answer) >= self.n - 1:
            banned = [t for t in self._next.get(tuple(self.answer[len(self.answer) - self.n + 1 :]), ()) if self._may_ban(t)]
            if banned and len(banned) < logits.numel():
                logits[torch.tensor(sorted(banned), dtype=torch.long, device=logits.device)] = float("-inf")
        return logits

    def _may_ban(self, token: int) -> bool:
        return self.bannable is None or token >= len(self.bannable) or bool(self.bannable[token])

    def add(self, token: int) -> None:
        self.answer.append(token)
        if self._seen is not None and token < self._seen.numel():
            self._seen[token] = True
        if self.n and len(self.answer) >= self.n:
            gram = self.answer[-self.n :]
            self._next.setdefault(tuple(gram[:-1]), set()).add(gram[-1])


class IncrementalDecoder:
    """Token ids to text a few tokens at a time (the prefix/read offsets of TGI and vLLM): each
    step decodes only the tokens since the last complete character, never the whole answer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # decoding starts here, so that a word's leading space comes out right
        self._read = 0  # text up to here has been returned

    def _decode(self, start: int, end: int | None = None) -> str:
        return cast(str, self._tokenizer.decode(self._ids[start:end], skip_special_tokens=True))  # one sequence: one text

    def add(self, token_id: int) -> str:
        """The new text `token_id` completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        """What is left, an incomplete character included (as a replacement character)."""
        rest = self._decode(self._prefix)[len(self._decode(self._prefix, self._read)) :]
        self._prefix = self._read = len(self._ids)
        return rest


class TextAssembler:
    """Turns generated token ids into text deltas, holding back what may still change: an
    incomplete UTF-8 character, and any tail that could be the start of a stop string. The text it
    keeps is the held tail plus the last few characters sent, so each token costs the same however
    long the answer is."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...]) -> None:
        self._decoder = IncrementalDecoder(tokenizer)
        self._stop = tuple(s for s in stop if s)
        self._lookback = max((len(s) for s in self._stop), default=1) - 1  # a stop may begin in text already sent
        self._window = ""  # the last `_lookback` characters sent, then the characters held back
        self._held = 0  # where the held characters begin in `_window`
        self.stopped = False

    def add(self, token_id: int) -> str:
        self._window += self._decoder.add(token_id)
        for stop in self._stop:
            at = self._window.find(stop)
            if at != -1:
                self.stopped = True
                return self._window[self._held : max(at, self._held)]
        return self._send(len(self._window) - self._held_tail())

    def flush(self) -> str:
        if self.stopped:
            return ""
        self._window += self._decoder.flush()
        return self._send(len(self._window))

    def _held_tail(self) -> int:
        """The longest end of the held text that begins a stop string."""
        held, longest = self._window[self._held :], 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(held)), longest, -1):
                if held.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _send(self, upto: int) -> str:
        delta = self._window[self._held : upto]
        keep_from = max(0, upto - self._lookback)
        self._window, self._held = self._window[keep_from:], upto - keep_from
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


class AnswerState:
    """One answer being generated: takes the logits of each step, keeps what sampling, the
    repetition guard and stop strings need, and says what to feed next. `decode_steps` drives one;
    engine/runtime/scheduler.py drives many in one forward pass."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], params: GenerationParams, stop_tokens: StopTokens
    ) -> None:
        self.started = time.perf_counter()
        self.prompt_tokens = len(prompt_ids)
        self.params = params
        self._stop_tokens = stop_tokens
        self._generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self._assembler = TextAssembler(tokenizer, params.stop)
        self._guard = RepetitionGuard(params, word_tokens(tokenizer) if params.no_repeat_ngram_size else None)
        self._ttft = 0.0
        self.produced = 0
        self.next_token: int | None = None  # sampled, not yet fed to the model
        self.finished = False

    def take(self, logits: torch.Tensor) -> list[TokenDelta | GenerationDone]:
        """Sample from the last position's logits [V]; the events this token completes (with
        `GenerationDone` last when the answer ends)."""
        params = self.params
        token = sample_next(self._guard.apply(logits.float().cpu()), params, self._generator)
        self._guard.add(token)
        self.produced += 1
        if self.produced == 1:
            self._ttft = time.perf_counter() - self.started
        if token in self._stop_tokens.ids and not params.ignore_eos:
            return self._finish("stop")
        events: list[TokenDelta | GenerationDone] = []
        delta = self._assembler.add(token)
        if delta:
            events.append(TokenDelta(delta))
        if self._assembler.stopped:
            return events + self._finish("stop")
        out_of_time = params.max_seconds is not None and time.perf_counter() - self.started > params.max_seconds
        if self.produced >= params.max_tokens or out_of_time:  # a time cap ends an answer as max_tokens does
            return events + self._finish("length")
        self.next_token = token
        return events

    def fed_answer(self) -> list[int]:
        """The answer's tokens the model has been fed (all sampled but the one waiting to be fed)."""
        answer = self._guard.answer
        return answer[:-1] if self.next_token is not None else list(answer)

    def _finish(self, reason: str) -> list[TokenDelta | GenerationDone]:
        self.finished, self.next_token = True, None
        tail = self._assembler.flush()
        done = GenerationDone(
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.produced,
            ttft_seconds=self._ttft,
            total_seconds=time.perf_counter() - self.started,
        )
        return [TokenDelta(tail), done] if tail else [done]


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
    state = AnswerState(tokenizer, prompt_ids, params, stop_tokens)
    ids = list(prompt_ids)
    while True:
        yield from state.take(forward(ids))
        if state.finished:
            return
        assert state.next_token is not None
        ids = [state.next_token]
