"""Admission: which requests wait, which join the batch at the next step, which were cancelled.

The engine asks the scheduler at every step; `add` and `cancel` may come from other threads (the
server's handlers) while a step runs, so every list here is touched under one lock. The policy is
first come, first served, up to `max_batch_size` running rows: a request joins at the first step with a
free row and stays until it finishes or is cancelled.
"""

from __future__ import annotations

import threading

from flashdraft.engine.sequence import Row

PAD_WASTE = 0.25  # a prefill group may pad its prompts by at most this share of their tokens


class Scheduler:
    def __init__(self, max_batch_size: int):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.waiting: list[Row] = []
        self.cancelled: set[str] = set()
        self.active: dict[str, Row] = {}  # running or waiting, by request id
        self.lock = threading.Lock()

    def add(self, row: Row) -> None:
        """Queue a validated row (ValueError if its id is already running or waiting)."""
        with self.lock:
            if row.request_id in self.active:
                raise ValueError(f"request id {row.request_id!r} is already in the batch: use a unique id")
            self.active[row.request_id] = row
            self.waiting.append(row)

    def cancel(self, request_id: str) -> None:
        """Unknown or already finished ids are ignored (a client may disconnect after its last token)."""
        with self.lock:
            if request_id in self.active:
                self.cancelled.add(request_id)

    def take_cancelled(self) -> set[str]:
        """The ids cancelled since the last call; waiting ones are dropped here, running ones are the
        engine's to free."""
        with self.lock:
            cancelled, self.cancelled = self.cancelled, set()
            self.waiting = [r for r in self.waiting if r.request_id not in cancelled]
        return cancelled

    def admit(self, running: int) -> list[Row]:
        """The waiting rows that join now, beside `running` rows."""
        with self.lock:
            n = max(0, self.max_batch_size - running)
            joining, self.waiting = self.waiting[:n], self.waiting[n:]
        return joining

    def finish(self, finished: dict[str, str]) -> None:
        """Rows that ended this step (id -> "stop", "length" or "cancelled") leave the books."""
        with self.lock:
            for request_id, why in finished.items():
                self.active.pop(request_id).finished = why
                self.cancelled.discard(request_id)  # a cancel that came in while it finished

    def pending(self) -> int:
        """Rows running plus rows waiting to join."""
        with self.lock:
            return len(self.active)


def prefill_groups(rows: list[Row]) -> list[list[Row]]:
    """The joining rows cut, in order, into runs whose left-padded prompts waste at most PAD_WASTE of
    their tokens: one forward per run. A batched prefill pads every prompt to the longest, and with
    chat prompts of 50-140 tokens half of a 16-row prefill was padding; on the int8 target a prefill
    costs about the same per token whatever the batch, so padding was pure loss there."""
    groups: list[list[Row]] = []
    for row in rows:
        group = groups[-1] if groups else None
        if group is not None:
            lens = [len(r.prompt) for r in group] + [len(row.prompt)]
            if max(lens) * len(lens) <= (1 + PAD_WASTE) * sum(lens):
                group.append(row)
                continue
        groups.append([row])
    return groups
