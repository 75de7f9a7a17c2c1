"""Continuous batching for ``tk serve`` on a decoder: requests join the running decode batch between steps.

``GenerationScheduler`` drives one ``tk.runtime.decode_batch.DecodeBatch`` from the replica's event
loop: between two engine calls it drops the rows whose client went away, admits waiting requests
(first come, first served, as many as the batch and its cache have room for; their prompts prefilled in
one call), else runs one decode step of every row. Each engine call runs in a worker thread, so the
event loop keeps reading requests and writing tokens to clients meanwhile. A request's tokens reach it
through its own queue as they are chosen (``stream``); a client that disconnects cancels its stream,
and its row leaves the batch before the next step.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tk.runtime.decode_batch import DecodeBatch, Row

Done = object()  # the end of a row's tokens in its queue


@dataclass
class _Waiting:
    row: Row
    queue: asyncio.Queue[object] = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # its reader went away
    ended: bool = False  # its last token (or an error) was queued: the row has left the batch


@dataclass
class SchedulerCounts:
    """What the scheduler did, for the server's metrics."""

    steps: int = 0  # decode steps
    prefills: int = 0  # prefill calls
    tokens: int = 0  # tokens chosen
    cancelled: int = 0  # rows whose client went away before their last token
    rows_per_step: list[int] = field(default_factory=list)  # kept short: the last 1,000


class GenerationScheduler:
    """Streams of tokens for generation requests, all decoded in one running batch."""

    def __init__(
        self,
        batch: DecodeBatch,
        on_call: Callable[[str, int, float], None] | None = None,
        on_cancel: Callable[[int], None] | None = None,
    ) -> None:
        self.batch = batch
        self.counts = SchedulerCounts()
        self._on_call = on_call  # (kind "prefill"/"decode", rows, seconds) after each engine call
        self._on_cancel = on_cancel  # (rows) when rows whose client went away leave the batch
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._live: dict[int, _Waiting] = {}  # row ident -> its waiter, for rows in the batch
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None

    @property
    def active(self) -> int:
        """Rows in the batch and requests waiting to join it."""
        return len(self._live) + len(self._waiting)

    async def stream(self, row: Row) -> AsyncIterator[tuple[int, str | None]]:
        """``row``'s tokens as they are chosen, each with how the row stood right after it (None: it goes on;
        else why it ended: the row's ``finish`` may have moved on by the time a slow reader gets the token).
        Closing the iterator early (the client went away) cancels the row."""
        waiter = _Waiting(row)
        self._waiting.append(waiter)
        self._ensure_worker()
        try:
            while True:
                item = await waiter.queue.get()
                if item is Done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item  # type: ignore[misc]
        finally:
            if not waiter.ended:
                waiter.cancelled = True
                assert self._wake is not None
                self._wake.set()

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wake = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._work())
        assert self._wake is not None
        self._wake.set()

    async def _work(self) -> None:
        assert self._wake is not None
        while True:
            self._drop_cancelled()
            newcomers = self._admissible()
            if newcomers:
                await self._call("prefill", newcomers)
            elif self.batch.rows:
                await self._call("decode", [self._live[r.ident] for r in self.batch.rows])
            else:
                self._wake.clear()
                if not self._waiting:
                    await self._wake.wait()
                elif not self.batch.room_for([self._waiting[0].row]):  # cannot happen: requests are checked
                    self._fail([self._waiting.popleft()], RuntimeError("request does not fit the cache"))

    def _drop_cancelled(self) -> None:
        gone = [w for w in self._live.values() if w.cancelled]
        self._waiting = collections.deque(w for w in self._waiting if not w.cancelled)
        for waiter in gone:
            waiter.row.finish = waiter.row.finish or "cancelled"
            del self._live[waiter.row.ident]
        if gone:
            self.counts.cancelled += len(gone)
            self.batch.drop([w.row for w in gone])
            if self._on_cancel is not None:
                self._on_cancel(len(gone))

    def _admissible(self) -> list[_Waiting]:
        """The oldest waiting requests that fit the batch now, in order (none past the first that does not)."""
        taken: list[_Waiting] = []
        while self._waiting and self.batch.room_for([w.row for w in taken] + [self._waiting[0].row]):
            taken.append(self._waiting.popleft())
        return taken

    async def _call(self, kind: str, waiters: list[_Waiting]) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            if kind == "prefill":
                for waiter in waiters:
                    self._live[waiter.row.ident] = waiter
                chosen = await asyncio.to_thread(self.batch.admit, [w.row for w in waiters])
                self.counts.prefills += 1
            else:
                chosen = await asyncio.to_thread(self.batch.step)
                self.counts.steps += 1
                self.counts.rows_per_step = [*self.counts.rows_per_step[-999:], len(chosen)]  # bounded memory
        except Exception as exc:  # the engine failed: every row in the batch gets the error, the server goes on
            self._fail(list(self._live.values()), exc)
            self.batch.drop(list(self.batch.rows))
            return
        seconds = loop.time() - started
        self.counts.tokens += len(chosen)
        for row, token in chosen:
            waiter = self._live[row.ident]
            waiter.queue.put_nowait((token, row.finish))  # no step runs now: finish is this token's
            if row.finish is not None:
                waiter.queue.put_nowait(Done)
                waiter.ended = True
                del self._live[row.ident]
        self.batch.drop([row for row, _ in chosen if row.finish is not None])
        if self._on_call is not None:
            self._on_call(kind, len(chosen), seconds)

    def _fail(self, waiters: list[_Waiting], exc: Exception) -> None:
        for waiter in waiters:
            waiter.row.finish = "error"
            waiter.ended = True
            waiter.queue.put_nowait(exc)
            self._live.pop(waiter.row.ident, None)
