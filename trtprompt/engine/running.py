"""The scheduler's running requests, in admission order, with O(1) updates."""

from __future__ import annotations

from typing import Iterator

from trtprompt.engine.request import Request


class _Link:
    """One request's place in the order. Mutable links, owned by RunningRequests alone."""

    __slots__ = ("request", "prev", "next")

    def __init__(self, request: Request, prev: _Link | None) -> None:
        self.request = request
        self.prev = prev
        self.next: _Link | None = None


class RunningRequests:
    """Running requests in admission order, the newest last.

    Appending, finding the newest and removing any one (it finished, or was
    preempted) are O(1), so a request leaves when it ends rather than at a
    rebuild of a list on every step. An iteration sees removals made while it
    runs: a removed request is not reached, and removing the one it stands on
    ends it (the scheduler, iterating, preempts only the newest: the last one).
    """

    def __init__(self) -> None:
        self._links: dict[str, _Link] = {}
        self._head: _Link | None = None
        self._tail: _Link | None = None

    def __len__(self) -> int:
        return len(self._links)

    def __contains__(self, req: Request) -> bool:
        link = self._links.get(req.request_id)
        return link is not None and link.request is req

    def __iter__(self) -> Iterator[Request]:
        link = self._head
        while link is not None:
            yield link.request
            link = link.next

    def append(self, req: Request) -> None:
        if req.request_id in self._links:
            raise ValueError(f"request {req.request_id} is already running")
        link = _Link(req, self._tail)
        if self._tail is None:
            self._head = link
        else:
            self._tail.next = link
        self._tail = link
        self._links[req.request_id] = link

    def newest(self) -> Request:
        if self._tail is None:
            raise IndexError("no request is running")
        return self._tail.request

    def remove(self, req: Request) -> bool:
        """Take req out of the order; False when it was not in it."""
        if req not in self:
            return False
        link = self._links.pop(req.request_id)
        if link.prev is None:
            self._head = link.next
        else:
            link.prev.next = link.next
        if link.next is None:
            self._tail = link.prev
        else:
            link.next.prev = link.prev
        link.prev = link.next = None  # an iteration standing on it ends (see the class doc)
        return True
