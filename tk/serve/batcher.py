"""Dynamic batching as Triton's scheduler does it: a batch forms when the engine is free.

Ray Serve's ``@serve.batch`` closes a batch when it is full or ``batch_wait_timeout_s`` after its
first request, whether the engine is busy or not: with a short timeout, the batches that form while
the engine computes are of one or two requests, each then waiting its turn; with a long one, a lone
request always waits the whole timeout. Triton forms a batch only when a model instance is free,
from every request queued by then, and waits ``max_queue_delay_microseconds`` (default 0) past the
oldest one's arrival only while the batch is below its maximum. ``Batcher`` does that, on the
replica's event loop: under load the batches are what queued during the last engine call, and at
one client no request waits. Measured against ``@serve.batch`` on 2 cores (benchmarks/history.md,
"Serving: batches formed when the engine is free").

One departure from Triton: a request that arrives while no other is in flight (queued or running)
does not wait the delay; it has no company coming, as far as the server can tell. A client alone paid
the whole delay on every request (``tk serve --tune`` chose 5 ms for 16 clients on 2 cores, where
the one-client overhead was then 7.2 ms against 2.0 without batching: benchmarks/history.md,
"Serving: no delay for a request alone"); under load every request finds others in flight.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class _Queued(NamedTuple):
    item: Any
    future: asyncio.Future[Any]
    arrived: float  # time.monotonic() at submit
    alone: bool  # no other request was in flight then: it does not wait for company


class Batcher(Generic[Item, Result]):
    """Runs ``run`` (a blocking function, called in a worker thread, one call at a time) on batches of
    submitted items: at most ``max_batch`` by ``size`` (each item's samples), in arrival order, and
    one ``run`` result per item. An item larger than ``max_batch`` runs alone."""

    def __init__(
        self,
        run: Callable[[list[Item]], Sequence[Result]],
        max_batch: int,
        max_delay_s: float = 0.0,
        size: Callable[[Item], int] = lambda item: 1,
    ) -> None:
        self._run = run
        self.max_batch = max(1, int(max_batch))
        self.max_delay_s = max(0.0, float(max_delay_s))
        self._size = size
        self._pending: collections.deque[_Queued] = collections.deque()
        self._in_flight = 0  # submitted requests not answered yet
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, item: Item) -> Result:
        """``item``'s result, once the batch it joined has run (its exception, if ``run`` raised)."""
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._arrived = asyncio.Event()
            self._worker = loop.create_task(self._work())
        future: asyncio.Future[Result] = loop.create_future()
        self._pending.append(_Queued(item, future, time.monotonic(), self._in_flight == 0))
        self._in_flight += 1
        assert self._arrived is not None
        self._arrived.set()
        try:
            return await future
        finally:
            self._in_flight -= 1

    def _queued_samples(self) -> int:
        return sum(self._size(q.item) for q in self._pending if not q.future.done())

    async def _work(self) -> None:
        assert self._arrived is not None
        while True:
            while not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
            if self.max_delay_s > 0 and not self._pending[0].alone:
                deadline = self._pending[0].arrived + self.max_delay_s
                while self._queued_samples() < self.max_batch and (left := deadline - time.monotonic()) > 0:
                    self._arrived.clear()
                    try:
                        await asyncio.wait_for(self._arrived.wait(), left)
                    except TimeoutError:
                        break
            batch = self._take()
            if not batch:
                continue
            items = [item for item, _ in batch]
            try:
                results = await asyncio.to_thread(self._run, items)
                if len(results) != len(items):
                    raise RuntimeError(f"batch function returned {len(results)} results for {len(items)} items")
            except Exception as exc:  # every request of the batch gets the error; the worker goes on
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():  # a client that went away cancelled its future
                    future.set_result(result)

    def _take(self) -> list[tuple[Item, asyncio.Future[Result]]]:
        """The oldest pending items that fit ``max_batch`` (at least one); cancelled ones dropped."""
        batch: list[tuple[Item, asyncio.Future[Result]]] = []
        samples = 0
        while self._pending:
            item, future = self._pending[0].item, self._pending[0].future
            if future.done():
                self._pending.popleft()
                continue
            size = self._size(item)
            if batch and samples + size > self.max_batch:
                break
            self._pending.popleft()
            batch.append((item, future))
            samples += size
        return batch
