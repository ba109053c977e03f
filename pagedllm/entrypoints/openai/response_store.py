"""Stored responses (``store: true``): GET /v1/responses/{id} and ``previous_response_id``.

Kept in memory, in insertion order with a bound: the oldest response is dropped first, so a
server answering forever holds at most ``max_responses`` of them."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.protocol_responses import ResponseObject


@dataclass(slots=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[dict[str, Any]]  # input items then output items, without the instructions


class ResponseStore:
    def __init__(self, max_responses: int = 1024) -> None:
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        self._responses[response.id] = StoredResponse(response, conversation)
        self._responses.move_to_end(response.id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None
