"""The requests waiting for the model (`PendingQueue`): their order, the queue's room and what is shed for it,
expiry, and taking a batch. Times come from the injected clock.

Order: the most urgent level first, then the earliest deadline (a request without one has its queueing time +
the request timeout, so that equal requests keep their arrival order), then the oldest. A full queue sheds its
least urgent, newest requests below the newcomer's level; shadow copies (`ticket.SHADOW`) are below every level.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from vit_serve.runtime.scheduling.result import Result
from vit_serve.runtime.scheduling.ticket import Ticket
from vit_serve.runtime.task import Task


@dataclass(eq=False, repr=False)  # no repr: deque.remove's "not in deque" error formats it (numpy's printer)
class Entry:
    """One queued request (or one part of a request of more than max_batch images)."""

    task: Task
    x: np.ndarray  # [n, 3, H, W]
    future: asyncio.Future[Result]
    ticket: Ticket
    deadline: float  # clock seconds: the ticket's, else queued + request_timeout_s
    t0: float  # clock seconds: when it was queued

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def level(self) -> int:
        return self.ticket.priority

    @property
    def order(self) -> tuple[int, float, float]:
        """The most urgent level first, then the earliest deadline, then the oldest."""
        return self.ticket.priority, self.deadline, self.t0


class PendingQueue:
    """At most `max_queue` waiting entries, with their rows counted per task."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._entries: deque[Entry] = deque()
        self._rows: dict[Task, int] = {}  # waiting rows per task

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    def __contains__(self, entry: object) -> bool:
        return entry in self._entries

    def rows(self, task: Task) -> int:
        """Images of `task` waiting."""
        return self._rows.get(task, 0)

    def first(self) -> Entry:
        """The most urgent entry (the queue is not empty)."""
        return min(self._entries, key=lambda i: i.order)

    def snapshot(self) -> tuple[Entry, ...]:
        return tuple(self._entries)

    def add(self, entries: list[Entry]) -> None:
        self._entries.extend(entries)
        for e in entries:
            self._rows[e.task] = self._rows.get(e.task, 0) + e.rows

    def drop(self, *entries: Entry) -> None:
        """Remove these entries (those no longer waiting are skipped)."""
        for entry in entries:
            with contextlib.suppress(ValueError):
                self._entries.remove(entry)
                self._rows[entry.task] -= entry.rows

    def clear(self) -> list[Entry]:
        """Remove every entry; the entries."""
        entries = list(self._entries)
        self._entries.clear()
        self._rows.clear()
        return entries

    def to_shed(self, entries: int, level: int) -> list[Entry] | None:
        """The waiting entries to shed so that `entries` more at `level` fit: the least urgent, newest first,
        below `level` only ([] when they fit); None when not enough are below it (the newcomer is refused)."""
        over = len(self._entries) + entries - self.max_queue
        if over <= 0:
            return []
        below = sorted((i for i in self._entries if i.level > level), key=lambda i: (-i.level, -i.t0))
        return None if len(below) < over else below[:over]

    def late(self, now: float, margin_s: Callable[[Entry], float]) -> list[Entry]:
        """The entries whose deadline is past at `now`, or within their `margin_s` of it."""
        return [i for i in self._entries if i.deadline <= now + margin_s(i)]

    def ahead(self, task: Task, before: Callable[[Entry], bool]) -> int:
        """Rows of `task` waiting for which `before` holds."""
        return sum(i.rows for i in self._entries if i.task == task and before(i))

    def of_task(self, task: Task) -> list[Entry]:
        """The entries of `task`, most urgent first."""
        return sorted((i for i in self._entries if i.task == task), key=lambda i: i.order)

    def take(self, batch: Iterable[Entry]) -> None:
        """Remove a batch's entries (one pass over the queue, whatever the batch's size)."""
        taken = {id(i): i for i in batch}
        self._entries = deque(i for i in self._entries if id(i) not in taken)
        for entry in taken.values():
            self._rows[entry.task] -= entry.rows
