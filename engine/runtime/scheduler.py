"""Continuous batching: the answers of one model are decoded together, one forward pass a step.

Requests join between steps and leave when they finish, are cancelled or fail. Each prompt is fed
on its own, `prefill_chunk` tokens a step between the others' steps, so a long prompt stalls the
others for one chunk at a time. Each keeps its own sampling, stop strings and repetition guard
(`AnswerState`), and its own key/value rows sized prompt + max_tokens, as reserved before it was
admitted. What one step computes is engine/models/llama_step.py (`BatchDecoder`); a model it does
not support is answered one request at a time.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncGenerator, Callable

import torch
from transformers import PreTrainedTokenizerBase

from engine.interface import GenerationDone, GenerationEvent, GenerationParams
from engine.models.llama_step import BatchDecoder, Row
from engine.runtime.generation import AnswerState, StopTokens
from engine.runtime.worker import SerialWorker

log = logging.getLogger(__name__)
_Events = list[tuple[Row, list[GenerationEvent | BaseException]]]  # what a tick hands each row


class Batcher:
    """Schedules the answers of one model on its worker thread, stepping them together."""

    def __init__(
        self,
        decoder: BatchDecoder,
        worker: SerialWorker,
        tokenizer: PreTrainedTokenizerBase,
        stop_tokens: StopTokens,
        max_rows: int,
        prefill_chunk: int | None = None,
    ) -> None:
        self._decoder = decoder
        self._worker = worker
        self._tokenizer = tokenizer
        self._stop_tokens = stop_tokens
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk  # prompt tokens fed a step (None: a whole prompt)
        self._waiting: collections.deque[Row] = collections.deque()
        self._rows: list[Row] = []  # touched on the worker thread only
        self._prefilling: Row | None = None  # the admitted row whose prompt is being fed, a chunk a step
        self._step_first = False  # the last tick ended a prompt: this one steps the rows before feeding any
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def rows(self) -> int:
        """Answers in the batch now (admitted, not yet finished)."""
        return len(self._rows)

    @torch.inference_mode()
    def warm_up(self, prompt_ids: list[int], params: GenerationParams) -> None:
        """One answer's prefill and decode step, thrown away, called directly (not through the
        worker) on the compute thread before the first tick (engine/runtime/registry.py's `warm_up` says why)."""
        row = Row(list(prompt_ids), params)
        row.state = AnswerState(self._tokenizer, row.prompt_ids, row.params, self._stop_tokens)
        row.state.take(self._decoder.prefill(row))
        row.state.take(self._decoder.step([row])[0])

    async def generate(self, prompt_ids: list[int], params: GenerationParams) -> AsyncGenerator[GenerationEvent, None]:
        """Text deltas, then done; leaving early cancels the row before its next step."""
        row = Row(list(prompt_ids), params)
        self._waiting.append(row)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        try:
            while True:
                event = await row.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, GenerationDone):
                    return
        finally:
            row.cancelled = True

    async def _run(self) -> None:
        """Tick while there is work. The next tick is queued before this one's events are handed
        out, so the compute thread steps again while the event loop streams them."""
        try:
            ticking = self._worker.start(self._tick)
            while True:
                done = await ticking
                busy = bool(self._rows or self._waiting or self._prefilling is not None)
                try:
                    if busy:
                        ticking = self._worker.start(self._tick)
                finally:  # a stopped worker fails the rows left below; those this tick ended get their events
                    for row, events in done:
                        for event in events:
                            row.events.put_nowait(event)
                if not busy:
                    return
        except BaseException as exc:  # shutdown, or a fault of the scheduler itself: no row waits forever
            failure = exc if isinstance(exc, Exception) else RuntimeError("the model worker stopped")
            prefilling = [] if self._prefilling is None else [self._prefilling]
            for row in [*list(self._rows), *prefilling, *list(self._waiting)]:
                row.cancelled = True
                row.keys = row.values = row.prompt_cache = None
                row.events.put_nowait(failure.with_traceback(None))
            self._rows, self._waiting, self._prefilling, self._step_first = [], collections.deque(), None, False
            if not isinstance(exc, Exception):
                raise
            log.exception("the batch scheduler failed; its answers ended with the error")

    @torch.inference_mode()
    def _tick(self) -> _Events:
        """On the worker thread: feed the admitted prompt its next chunk (admitting a waiting row
        when none is being fed), then step every row once. A tick whose chunk ends a prompt
        returns there, so that row's first token goes out before a decode step; the next tick
        steps every row, that one too, and feeds no prompt."""
        out: _Events = []
        self._keep_live()
        step_first, self._step_first = self._step_first and bool(self._rows), False
        while not step_first and self._prefilling is None and self._waiting and len(self._rows) < self.max_rows:
            row = self._waiting.popleft()
            if not row.cancelled:
                row.state = AnswerState(self._tokenizer, row.prompt_ids, row.params, self._stop_tokens)
                self._prefilling = row
        if self._prefilling is not None and not step_first:
            self._feed(self._prefilling, out)
            if self._prefilling is None and out:  # the prompt is in, and its first token (or error) is out
                self._step_first = True
                self._keep_live()
                return out
        self._keep_live()
        if self._rows:
            self._advance(self._rows, self._decoder.step, out)
        self._keep_live()
        return out

    def _feed(self, row: Row, out: _Events) -> None:
        """One chunk of the admitted row's prompt; with its last chunk it joins the batch with its
        first token. A cancelled or failed prefill ends that row alone."""
        if row.cancelled:
            self._prefilling, row.prompt_cache = None, None
            return
        try:
            logits = self._decoder.prefill_part(row, self.prefill_chunk)
        except Exception as exc:
            self._prefilling, row.prompt_cache, row.cancelled = None, None, True
            out.append((row, [exc.with_traceback(None)]))
            return
        if logits is None:
            return  # more of its prompt on the next tick
        self._prefilling = None
        self._advance([row], lambda rows: logits.unsqueeze(0), out)
        self._rows.append(row)

    def _keep_live(self) -> None:
        """Drop rows that finished, failed or were cancelled, and their keys and values."""
        for row in self._rows:
            if row.cancelled or row.state is None or row.state.finished:
                row.keys = row.values = None
        self._rows = [row for row in self._rows if row.keys is not None]

    def _advance(self, rows: list[Row], forward: Callable[[list[Row]], torch.Tensor], out: _Events) -> None:
        """Run `forward` on `rows` and hand each its logits. A failed step is retried row by row
        (a row's position only moves when its step succeeds), so an error ends only its own row."""
        try:
            logits = forward(rows).float().cpu()  # one copy for the batch, not one per row
        except Exception as exc:
            if len(rows) > 1:
                for row in rows:
                    self._advance([row], forward, out)
                return
            rows[0].cancelled = True
            out.append((rows[0], [exc.with_traceback(None)]))
            return
        for i, row in enumerate(rows):
            assert row.state is not None
            try:
                out.append((row, list(row.state.take(logits[i]))))
            except Exception as exc:
                row.cancelled = True
                out.append((row, [exc.with_traceback(None)]))
