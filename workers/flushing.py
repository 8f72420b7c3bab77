"""Group commit: the flushes of a worker's decoding runs are written
together, one transaction per flush interval whatever the batch size.

Why: every run in the batch gets its token at the same decoding step, so its
job thread flushes at about the same moment as the others. Written one
transaction per run, eight rows cost eight lock queries, inserts, updates
and commits per step, Python work that shares the interpreter lock with the
decoding thread (measured: the batch of 8 ran at 0.53x a raw static batch;
0.80x with flushes held back to one a second).

So the flush interval is kept per worker, not per run (``due``), and the
first thread to flush in an interval gathers the others of the same step
before it writes: it waits until every decoding run has queued its flush,
or ``GATHER_SECONDS`` at most, then writes them all
(``tasks_app.checkpoints.record_progress_many``) while the others wait for
their result. A lone run writes at once, as before. If a grouped write
fails, each flush is written again alone, so one bad flush fails only its
own run.

Only a write that carries something (events or tokens) starts a new
interval. A run waiting for its first token (a long prompt computed in
chunks) flushes every ``IDLE_FLUSH_SECONDS`` to notice a cancel; when those
empty writes restarted the interval, the decoding runs, which ask ``due``
once a token, at steps of 240 ms beside a 3,500-token prompt, found it
restarted under 150 ms before, step after step: their streams got no text
for 1.1-1.7 s while the engine stepped on (issue 42).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tasks_app import checkpoints

# How long the first flush of a step waits for the other rows' threads; they
# wake one after the other for the same step, within a millisecond or two.
GATHER_SECONDS = 0.005


class _Slot:
    def __init__(self, flush: checkpoints.Flush) -> None:
        self.flush = flush
        self.written = False
        self.progress: checkpoints.Progress | None = None
        self.error: BaseException | None = None


class FlushGroup:
    """Writes ``checkpoints.Flush`` es from many job threads in groups."""

    def __init__(self) -> None:
        self._writing = threading.Lock()  # held by the thread writing a group
        self._changed = threading.Condition()  # guards the fields below
        self._queued: list[_Slot] = []
        self._decoding = 0
        self._last_write = 0.0

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Count a run as decoding (getting a token each step) while inside."""
        with self._changed:
            self._decoding += 1
        try:
            yield
        finally:
            with self._changed:
                self._decoding -= 1
                self._changed.notify_all()

    def due(self, interval: float) -> bool:
        """Whether this worker's runs have not been flushed for ``interval``."""
        return time.monotonic() >= self.next_due(interval)

    def next_due(self, interval: float) -> float:
        """When (``time.monotonic()``) this worker's runs are next flushed."""
        return self._last_write + interval

    def write(self, flush: checkpoints.Flush) -> checkpoints.Progress:
        """Write ``flush`` together with the flushes queued beside it; its run's
        progress (raises what its write raised)."""
        slot = _Slot(flush)
        with self._changed:
            self._queued.append(slot)
            self._changed.notify_all()
        with self._writing:
            if not slot.written:  # no earlier writer took it: gather, then write
                deadline = time.monotonic() + GATHER_SECONDS
                with self._changed:
                    while len(self._queued) < self._decoding:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._changed.wait(left)
                    group, self._queued = self._queued, []
                    if any(queued.flush.events or queued.flush.new_token_ids for queued in group):
                        self._last_write = time.monotonic()
                _write(group)
        if slot.error is not None:
            raise slot.error
        assert slot.progress is not None
        return slot.progress


def _write(group: list[_Slot]) -> None:
    try:
        results = checkpoints.record_progress_many([slot.flush for slot in group])
    except Exception as exc:
        if len(group) == 1:
            group[0].error = exc
        else:
            for slot in group:
                _write([slot])
            return
    else:
        for slot, progress in zip(group, results, strict=True):
            slot.progress = progress
    for slot in group:
        slot.written = True


flush_group = FlushGroup()
