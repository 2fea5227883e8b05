"""Open-loop load: requests sent at their arrival times (Poisson, constant rate or a trace's own timestamps),
whatever the server's pace; a multi-turn session's next turn waits for the previous turn to finish.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from random import Random

import aiohttp
from tqdm.asyncio import tqdm

from pdserve.bench.client import ClientConfig, RequestResult, send
from pdserve.bench.datasets import BenchRequest

ARRIVALS = ("poisson", "constant")


def arrival_offsets(count: int, rate: float, arrival: str, seed: int) -> list[float]:
    """Send times in seconds from the start: the first at 0, then exponential (Poisson) or equal gaps of mean
    1 / rate; an infinite rate sends everything at once."""
    if arrival not in ARRIVALS:
        raise ValueError(f"unknown arrival process {arrival!r}; one of {', '.join(ARRIVALS)}")
    if rate <= 0:
        raise ValueError(f"the request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * count
    rng = Random(seed)
    offsets, now = [], 0.0
    for index in range(count):
        if index:
            now += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
        offsets.append(now)
    return offsets


def schedule(requests: Sequence[BenchRequest], rate: float, arrival: str, seed: int) -> list[float]:
    """A trace's own times where it has them, else the arrival process's."""
    if requests and all(r.arrival_s is not None for r in requests):
        return [r.arrival_s for r in requests]
    return arrival_offsets(len(requests), rate, arrival, seed)


AbortPolicy = Callable[[int, BenchRequest], int | None]  # (index, request) -> disconnect after this many tokens


class LoadRun:
    """Sends `requests` at `offsets`; at most `max_concurrency` in flight when given."""

    def __init__(self, config: ClientConfig, requests: Sequence[BenchRequest], offsets: Sequence[float],
                 max_concurrency: int | None = None, abort_policy: AbortPolicy | None = None,
                 progress: bool = True, description: str = ""):
        if len(offsets) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(offsets)} send times")
        self.config = config
        self.requests = requests
        self.offsets = offsets
        self.limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self.abort_policy = abort_policy
        self.progress = progress
        self.description = description
        self.turn_done: dict[tuple[int, int], asyncio.Event] = {}

    async def run(self) -> tuple[list[RequestResult], float]:
        """Every request's result (in request order) and the wall time from the first send to the last answer."""
        for request in self.requests:
            if request.session is not None:
                self.turn_done[(request.session, request.turn)] = asyncio.Event()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            bar = tqdm(total=len(self.requests), disable=not self.progress, desc=self.description, unit="req")
            start = time.perf_counter()
            tasks = [asyncio.create_task(self._one(session, index, start, bar)) for index in range(len(self.requests))]
            try:
                results = await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                bar.close()
            return list(results), time.perf_counter() - start

    async def _one(self, session: aiohttp.ClientSession, index: int, start: float, bar: tqdm) -> RequestResult:
        request = self.requests[index]
        await asyncio.sleep(max(0.0, start + self.offsets[index] - time.perf_counter()))
        if request.session is not None and request.turn:
            await self.turn_done[(request.session, request.turn - 1)].wait()
        sent = time.perf_counter()
        abort_after = self.abort_policy(index, request) if self.abort_policy else None
        if self.limit is None:
            result = await send(session, self.config, request, abort_after)
        else:
            async with self.limit:
                result = await send(session, self.config, request, abort_after)
        result.start_s = sent - start
        if request.session is not None:
            self.turn_done[(request.session, request.turn)].set()
        bar.update(1)
        return result
