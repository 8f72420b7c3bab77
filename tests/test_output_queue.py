"""A request's records between the engine's thread and its reader
(``engine.interface.OutputQueue``): given at once unless held, held ones
given together when the hold ends, a finishing record at once. Plain
Python: a thread stands for the engine."""

from __future__ import annotations

import threading
import time

from engine.interface import EngineOutput, FinishReason, OutputQueue


def put_later(queue: OutputQueue, delays_and_records: list[tuple[float, EngineOutput]]) -> None:
    def run() -> None:
        for delay, record in delays_and_records:
            time.sleep(delay)
            queue.put(record)

    threading.Thread(target=run, daemon=True).start()


def token(token_id: int) -> EngineOutput:
    return EngineOutput("r", (token_id,))


def test_without_a_hold_each_record_is_given_as_it_comes_and_none_after_poll() -> None:
    queue = OutputQueue()
    put_later(queue, [(0.05, token(1)), (0.05, token(2))])
    reads = queue.outputs(poll=1.0)
    assert [r.new_token_ids for r in next(reads)] == [(1,)]
    assert [r.new_token_ids for r in next(reads)] == [(2,)]
    started = time.monotonic()
    assert next(reads) == []  # poll seconds without a record
    assert time.monotonic() - started >= 0.99


def test_held_records_come_together_when_the_hold_ends_and_a_finish_at_once() -> None:
    queue = OutputQueue()
    reads = queue.outputs(poll=5.0)
    held_from = time.monotonic()
    queue.hold(held_from + 0.5)
    put_later(queue, [(0.05, token(1)), (0.05, token(2)), (0.05, token(3))])
    taken = next(reads)
    assert time.monotonic() - held_from >= 0.5  # not woken by the records before it ended
    assert [r.new_token_ids for r in taken] == [(1,), (2,), (3,)]
    assert taken[0].made_at < taken[-1].made_at  # each keeps when it was made

    queue.hold(time.monotonic() + 5.0)
    finished = EngineOutput("r", (), FinishReason.EOS)
    put_later(queue, [(0.05, token(4)), (0.05, finished)])
    started = time.monotonic()
    taken = next(reads)
    assert time.monotonic() - started < 2.0  # the finish woke it, long before the hold's end
    assert [r.new_token_ids for r in taken] == [(4,), ()]
    assert taken[-1].finish_reason is FinishReason.EOS
    assert list(reads) == []  # the stream ends after the finishing record
