"""tk.serve.batcher: batches form when the engine is free, as Triton's scheduler forms them."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tk.serve.batcher import Batcher


class Engine:
    """A blocking batch function that records each batch it ran; ``gate`` holds a call until set,
    ``entered`` is set once a call has begun."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, items: list[int]) -> list[int]:
        self.entered.set()
        self.gate.wait(timeout=10)
        time.sleep(self.seconds)
        self.batches.append(list(items))
        return [item * 10 for item in items]


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


def test_requests_queued_while_the_engine_runs_form_the_next_batch_in_order():
    engine = Engine()

    async def main() -> list[int]:
        batcher = Batcher(engine, max_batch=8)
        engine.gate.clear()
        first = asyncio.ensure_future(batcher.submit(1))
        await _until(engine.entered.is_set)  # the engine took the lone request at once
        rest = [asyncio.ensure_future(batcher.submit(i)) for i in range(2, 7)]
        await asyncio.sleep(0.05)
        engine.gate.set()
        return await asyncio.gather(first, *rest)

    assert asyncio.run(main()) == [10, 20, 30, 40, 50, 60]
    assert engine.batches == [[1], [2, 3, 4, 5, 6]]


def test_a_batch_holds_at_most_max_batch_samples_and_a_larger_request_runs_alone():
    engine = Engine()
    sizes = {1: 3, 2: 3, 3: 3, 4: 9, 5: 1}

    async def main() -> None:
        batcher = Batcher(engine, max_batch=6, size=lambda item: sizes[item])
        engine.gate.clear()
        tasks = [asyncio.ensure_future(batcher.submit(i)) for i in sizes]
        await asyncio.sleep(0.05)
        engine.gate.set()
        assert await asyncio.gather(*tasks) == [10, 20, 30, 40, 50]

    asyncio.run(main())
    assert engine.batches == [[1, 2], [3], [4], [5]]  # 3+3 fit 6; 3+9 does not; 9 alone; then 1


def test_a_request_in_company_waits_the_delay_and_one_alone_does_not():
    async def pair(delay_s: float) -> tuple[float, list[list[int]]]:
        engine = Engine()
        batcher = Batcher(engine, max_batch=8, max_delay_s=delay_s)
        engine.gate.clear()
        started = time.monotonic()
        first = asyncio.ensure_future(batcher.submit(1))  # alone: runs at once, whatever the delay
        await _until(engine.entered.is_set)
        second = asyncio.ensure_future(batcher.submit(2))  # the first is in flight: company may come
        await asyncio.sleep(0.02)
        engine.gate.set()
        await asyncio.sleep(0.05)
        third = asyncio.ensure_future(batcher.submit(3))
        await asyncio.gather(first, second, third)
        return time.monotonic() - started, engine.batches

    _, batches = asyncio.run(pair(0.0))
    assert batches == [[1], [2], [3]]  # no wait: each ran when the engine was free
    _, batches = asyncio.run(pair(2.0))
    assert batches == [[1], [2, 3]]  # the second held up to 2 s past its arrival for a third
    elapsed, batches = asyncio.run(pair(0.3))
    assert batches == [[1], [2, 3]] and elapsed < 1.5


def test_a_client_alone_never_waits_the_delay():
    engine = Engine()

    async def main() -> float:
        batcher = Batcher(engine, max_batch=8, max_delay_s=30.0)
        started = time.monotonic()
        for i in range(5):  # one request after another, each answered before the next
            assert await batcher.submit(i) == i * 10
        return time.monotonic() - started

    assert asyncio.run(main()) < 10.0
    assert engine.batches == [[0], [1], [2], [3], [4]]


def test_a_full_batch_does_not_wait_for_the_delay():
    engine = Engine()

    async def main() -> float:
        batcher = Batcher(engine, max_batch=2, max_delay_s=30.0)
        started = time.monotonic()
        await asyncio.gather(batcher.submit(1), batcher.submit(2))
        return time.monotonic() - started

    assert asyncio.run(main()) < 10.0
    assert engine.batches == [[1, 2]]


def test_an_engine_error_reaches_every_request_of_its_batch_and_the_next_batch_still_runs():
    calls: list[list[int]] = []

    def run(items: list[int]) -> list[int]:
        calls.append(list(items))
        if 2 in items:
            raise ValueError("engine failed")
        return items

    async def main() -> None:
        batcher = Batcher(run, max_batch=8)
        results = await asyncio.gather(batcher.submit(2), batcher.submit(3), return_exceptions=True)
        assert [type(r) for r in results] == [ValueError, ValueError]
        assert await batcher.submit(4) == 4

    asyncio.run(main())
    assert calls == [[2, 3], [4]]


def test_a_cancelled_request_is_dropped_and_does_not_stop_the_worker():
    engine = Engine()

    async def main() -> None:
        batcher = Batcher(engine, max_batch=8)
        engine.gate.clear()
        first = asyncio.ensure_future(batcher.submit(1))
        await _until(engine.entered.is_set)
        gone = asyncio.ensure_future(batcher.submit(2))
        kept = asyncio.ensure_future(batcher.submit(3))
        await asyncio.sleep(0.01)
        gone.cancel()
        engine.gate.set()
        assert await first == 10 and await kept == 30
        with pytest.raises(asyncio.CancelledError):
            await gone

    asyncio.run(main())
    assert engine.batches == [[1], [3]]


def test_a_batch_function_that_returns_the_wrong_count_fails_its_requests():
    async def main() -> None:
        batcher = Batcher(lambda items: [0], max_batch=8)
        results = await asyncio.gather(batcher.submit(1), batcher.submit(2), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) and "1 results for 2 items" in str(r) for r in results)

    asyncio.run(main())
