"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival, id))."""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from pagedllm.core.request import Request


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        """Back to the head: a preempted request resumes before newer arrivals."""
        self._queue.appendleft(request)

    def prepend_requests(self, requests: list[Request]) -> None:
        """Put back, in order, requests popped for a look past the head."""
        self._queue.extendleft(reversed(requests))

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest (priority, arrival_time, request_id) first; Request.__lt__ defines the order.

    A preempted request keeps its place by its own key, so "prepend" is just a push.
    """

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    prepend_request = add_request

    def prepend_requests(self, requests: list[Request]) -> None:
        for r in requests:
            heapq.heappush(self._heap, r)

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [r for r in self._heap if id(r) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    if policy == "priority":
        return PriorityRequestQueue()
    if policy == "fcfs":
        return FCFSRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
