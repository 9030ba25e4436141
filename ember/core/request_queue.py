"""The scheduler's waiting queues: first come first served, or by priority (vLLM's two policies).

Both offer the deque operations the scheduler uses: `append` (a new request), `appendleft` (a
preempted one going back), `[0]` (the next to admit), `popleft`, `remove`, `len` and iteration.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from ember.core.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


class FCFSQueue(deque):
    """Arrival order; a preempted request goes back to the front (it was admitted first)."""


class PriorityQueue:
    """Lowest `priority` value first, ties by arrival time (then by insertion, for equal times).

    A sorted list, not a heap: the scheduler peeks at the head every step and removes aborted
    requests from the middle, and waiting queues are hundreds long, not millions."""

    def __init__(self) -> None:
        self._items: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    @staticmethod
    def key(request: Request) -> tuple[int, float]:
        return request.priority, request.metrics.arrival_time

    def append(self, request: Request) -> None:
        bisect.insort(self._items, (*self.key(request), next(self._counter), request),
                      key=lambda item: item[:3])

    # A preempted request keeps its priority and arrival time, so it goes back to its rank.
    appendleft = append

    def popleft(self) -> Request:
        return self._items.pop(0)[3]

    def remove(self, request: Request) -> None:
        for i, item in enumerate(self._items):
            if item[3] is request:
                del self._items[i]
                return
        raise ValueError("request is not waiting")

    def __getitem__(self, index: int) -> Request:
        return self._items[index][3]

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return (item[3] for item in self._items)


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
