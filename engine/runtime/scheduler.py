"""Continuous batching: the answers of one model are decoded together, one forward pass a step.

Requests join between steps and leave when they finish, are cancelled or fail. Each prompt is fed
on its own, `prefill_chunk` tokens a step between the others' steps, so a long prompt stalls the
others for one chunk at a time. Each keeps its own sampling, stop strings and repetition guard
(`AnswerState`), and its own key/value rows. With `KVBlocks` those are held from the server's memory
in blocks as they fill (engine/runtime/kv_blocks.py): a prompt waits at the head of the queue until
its blocks can be held, and a row that needs a block when memory is short takes it from the youngest
row, which is preempted and resumes later; without, a row gets prompt + max_tokens positions at
once. A session's row starts its prompt from the longest prefix it shares with that session's
last prompt, kept by `PrefixCache` (engine/runtime/prefix_cache.py). What one step computes
is engine/models/llama_step.py (`BatchDecoder`); a model it does not support is answered one
request at a time. Background rows (summaries) wait in a queue of their
own, admitted only when no answer waits; one whose prompt is being fed steps aside for an arriving
answer and goes on from where it was.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncGenerator, Callable

import torch
from transformers import PreTrainedTokenizerBase

from engine.errors import BudgetExceededError, LongdocError
from engine.interface import GenerationDone, GenerationEvent, GenerationParams
from engine.models.llama_step import BatchDecoder, Row
from engine.models.quantize import DECODE_ROWS
from engine.runtime.generation import AnswerState, StopTokens
from engine.runtime.kv_blocks import KVBlocks
from engine.runtime.prefix_cache import Owner, PrefixCache
from engine.runtime.worker import SerialWorker

log = logging.getLogger(__name__)
_Events = list[tuple[Row, list[GenerationEvent | BaseException]]]  # what a tick hands each row
STALLED_PAUSE_SECONDS = 0.02  # a tick that could neither feed nor step (memory short): the next one after this


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
        kv: KVBlocks | None = None,
        prefix: PrefixCache | None = None,
    ) -> None:
        self._decoder = decoder
        self._worker = worker
        self._tokenizer = tokenizer
        self._stop_tokens = stop_tokens
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk  # prompt tokens fed a step (None: a whole prompt)
        self._waiting: collections.deque[Row] = collections.deque()
        # work no client waits on (summaries): admitted only when no answer waits, and a background
        # prompt being fed steps aside (keeping what it has fed) when an answer arrives
        self._background: collections.deque[Row] = collections.deque()
        self._rows: list[Row] = []  # touched on the worker thread only
        self._prefilling: Row | None = None  # the admitted row whose prompt is being fed, a chunk a step
        self._step_first = False  # the last tick ended a prompt: this one steps the rows before feeding any
        self._stalled = False  # the last tick could neither feed nor step: rows wait for memory
        self._loop_task: asyncio.Task[None] | None = None
        self.kv = kv  # None: each row gets prompt + max_tokens positions, held by its request
        self.prefix = prefix  # each session's last prompt's keys and values (None: every prompt fed whole)
        # what a prompt's own cache (the model's dtype) takes a token while it is fed
        self._prompt_bytes = 0
        if kv is not None:
            model_dtype = next(decoder.model.parameters()).dtype
            self._prompt_bytes = kv.bytes_per_token * model_dtype.itemsize // decoder.cache_dtype.itemsize

    @property
    def waiting(self) -> int:
        """Answers queued for a place in the batch or for memory (preempted ones included)."""
        return len(self._waiting) + len(self._background) + (self._prefilling is not None)

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

    async def generate(
        self, prompt_ids: list[int], params: GenerationParams, *, background: bool = False, owner: Owner | None = None
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Text deltas, then done; leaving early cancels the row before its next step. A
        `background` row waits while any answer does. An `owner`'s (a session's) prompts start
        from the prefix they share with its last one."""
        row = Row(list(prompt_ids), params, background=background, owner=owner)
        row.keep_prompt = owner is not None and self.prefix is not None
        (self._background if background else self._waiting).append(row)
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
                busy = bool(self._rows or self._waiting or self._background or self._prefilling is not None)
                try:
                    if busy:
                        if self._stalled:  # waiting for memory that only others can free: no spinning
                            await asyncio.sleep(STALLED_PAUSE_SECONDS)
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
            for row in [*list(self._rows), *prefilling, *list(self._waiting), *list(self._background)]:
                row.cancelled = True
                self._free(row)
                row.events.put_nowait(failure.with_traceback(None))
            self._rows, self._waiting, self._prefilling, self._step_first = [], collections.deque(), None, False
            self._background = collections.deque()
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
        self._stalled = False
        self._keep_live()
        step_first, self._step_first = self._step_first and bool(self._rows), False
        if self._prefilling is not None and self._prefilling.background and self._waiting:
            self._background.appendleft(self._prefilling)  # an answer first; it keeps what it has fed
            self._prefilling = None
        while not step_first and self._prefilling is None and len(self._rows) < self.max_rows:
            queue = self._waiting or self._background
            if not queue:
                break
            row = queue[0]
            fed_before = row.prompt_cache is not None  # a background row that stepped aside holds its blocks
            if not row.cancelled and not fed_before and not self._hold_prompt(row, out) and not row.cancelled:
                if not row.background and self._drop_background_prompts():
                    continue  # what background prompts held is back: the answer tries again
                break  # the server's memory is short: it waits at the head of the queue
            queue.popleft()
            if row.cancelled:  # also when its client left after its blocks were held
                self._free(row)
            else:
                if row.state is None:  # a preempted row keeps its state
                    row.state = AnswerState(self._tokenizer, row.prompt_ids, row.params, self._stop_tokens)
                if not fed_before:
                    self._start_from_prefix(row)
                self._prefilling = row
        if self._prefilling is not None and not step_first:
            self._feed(self._prefilling, out)
            if self._prefilling is None and out:  # the prompt is in, and its first token (or error) is out
                self._step_first = True
                self._keep_live()
                return out
        self._keep_live()
        self._grow(out)
        if self._rows:
            self._advance(self._rows, self._decoder.step, out)
        self._keep_live()
        self._stalled = not out and not self._rows and self._prefilling is None and bool(self._waiting)
        return out

    def _hold_prompt(self, row: Row, out: _Events) -> bool:
        """Hold the blocks the row's prompt fills, and its cache while it is fed, when the running
        rows could still grow once beside them: True when held. False when it could never fit (it
        fails) or memory is short: it waits, and once the head of the queue has waited
        `wait_seconds` with no answer of this model running to free any, every waiting row fails."""
        kv = self.kv
        if kv is None:
            return True
        tokens = len(row.ids())
        blocks, extra = kv.blocks(tokens + 1), tokens * self._prompt_bytes
        try:
            held = kv.hold(row, blocks, extra)
        except LongdocError as exc:  # larger than the server's whole budget
            row.cancelled = True
            out.append((row, [exc]))
            return False
        if held and self._rows and not self._roomy(row, blocks, extra):
            kv.release(row)
            held = False
        if held:
            row.room, row.waiting_since = blocks * kv.block_tokens, None
            return True
        if self._rows:  # they will give memory back: no clock runs
            row.waiting_since = None
            return False
        now = time.monotonic()
        row.waiting_since = row.waiting_since or now
        if now - row.waiting_since > kv.wait_seconds:
            error = BudgetExceededError(
                f"the server's memory had no room for a {tokens}-token prompt for {kv.wait_seconds:g} s "
                "(retry after other sessions are deleted or expire)",
                60.0,
            )
            for waiting in self._waiting if not row.background else self._background:  # they would wait for the same memory
                waiting.cancelled = True
                out.append((waiting, [error]))
        return False

    def _drop_background_prompts(self) -> bool:
        """Free what background rows that stepped aside hold of their half-fed prompts (they feed
        them again from the start later); True when any was freed."""
        aside = [row for row in self._background if row.prompt_cache is not None]
        for row in aside:
            self._free(row)
        return bool(aside)

    def _start_from_prefix(self, row: Row) -> None:
        """Start the row's prompt cache from the longest prefix it shares with its owner's last
        prompt, leaving at least one token to feed (more than DECODE_ROWS where a short part would
        run through the low-precision weights: see `BatchDecoder.whole_tail`)."""
        if self.prefix is None or row.owner is None:
            return
        ids = row.ids()
        most = len(ids) - (DECODE_ROWS + 1 if self._decoder.whole_tail else 1)
        started = self.prefix.start(row.owner, ids, most)
        if started is not None:
            row.prompt_cache, row.fed = started

    def _keep_prompt(self, row: Row) -> None:
        """Hand the row's fed prompt's keys and values to the prefix cache, as its owner's last prompt."""
        kept, row.kept = row.kept, None
        if self.prefix is not None and row.owner is not None and kept is not None:
            self.prefix.keep(row.owner, row.ids(), kept)

    def _roomy(self, row: Row, blocks: int, extra: int) -> bool:
        """Whether, beside the row's `blocks`, each running row could grow once: every growth's
        blocks, and the largest row's old buffers held while it copies (growths come one at a time)."""
        assert self.kv is not None
        growths = [max(1, running.blocks // 8) for running in self._rows]
        copy = max(running.blocks + growth for running, growth in zip(self._rows, growths, strict=True))
        try:
            roomy = self.kv.hold(row, blocks + sum(growths) + copy, extra)
        except LongdocError:
            return False
        return roomy and self.kv.hold(row, blocks, extra)

    def _grow(self, out: _Events) -> None:
        """Give each row whose keys are full room for more, an eighth of its blocks (at least one)
        at a time up to prompt + max_tokens, or one block when that is all memory allows; while the
        server's memory is short, preempt the youngest row (the row itself when it is the
        youngest). An error growing a row ends that row alone."""
        kv = self.kv
        if kv is None:
            return
        for row in list(self._rows):
            if row not in self._rows or row.keys is None or row.length < row.keys.shape[2]:
                continue
            limit = kv.blocks(len(row.prompt_ids) + row.params.max_tokens)
            least = kv.blocks(row.length + 1)
            wanted = max(least, min(row.blocks + max(1, row.blocks // 8), limit))
            try:
                while row in self._rows:
                    grown = next((b for b in dict.fromkeys((wanted, least)) if kv.hold(row, row.blocks + b)), None)
                    if grown is not None:  # it held the old buffers and the new while copying
                        self._decoder.grow(row, grown * kv.block_tokens)
                        kv.hold(row, grown)
                        break
                    self._preempt(self._rows[-1])
            except Exception as exc:  # larger than the server's budget, or the allocation failed
                row.cancelled = True
                self._free(row)
                out.append((row, [exc.with_traceback(None)]))

    def _preempt(self, row: Row) -> None:
        """Give back the row's blocks and queue it first, to feed its prompt and answer again."""
        assert self.kv is not None and row.state is not None
        self._free(row)
        row.resumed, row.room = row.state.fed_answer(), 0
        self._rows.remove(row)
        (self._background if row.background else self._waiting).appendleft(row)
        self.kv.preemptions += 1
        log.info("preempted an answer at %d tokens: the server's memory is short", row.length)

    def _free(self, row: Row) -> None:
        """Drop the row's keys and values and give back the memory they held."""
        row.keys = row.values = row.prompt_cache = row.kept = None
        if self.kv is not None:
            self.kv.release(row)

    def _feed(self, row: Row, out: _Events) -> None:
        """One chunk of the admitted row's prompt; with its last chunk it joins the batch with its
        first token. A cancelled or failed prefill ends that row alone."""
        if row.cancelled:
            self._prefilling = None
            self._free(row)
            return
        try:
            logits = self._decoder.prefill_part(row, self.prefill_chunk)
        except Exception as exc:
            self._prefilling, row.cancelled = None, True
            self._free(row)
            out.append((row, [exc.with_traceback(None)]))
            return
        if logits is None:
            return  # more of its prompt on the next tick
        self._prefilling = None
        if self.kv is not None:
            self.kv.hold(row, row.blocks)  # the prompt's own cache is gone, or handed on:
        self._keep_prompt(row)  # the prefix cache reserves what it keeps of it (or drops it)
        assert row.state is not None
        if row.state.produced == 0:
            self._advance([row], lambda rows: logits.unsqueeze(0), out)
        # a resumed row had sampled its next token from these logits before it was preempted
        self._rows.append(row)

    def _keep_live(self) -> None:
        """Drop rows that finished, failed or were cancelled, and their keys and values."""
        for row in self._rows:
            if row.cancelled or row.state is None or row.state.finished:
                self._free(row)
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
