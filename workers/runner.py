"""Running one task: the plain function behind the Celery job.

The run claims the task, restores where an earlier attempt stopped (its
checkpoint), generates in the model's continuous batch (``batching``), and
writes events in batches: one transaction per flush, at most every
``LMSP_FLUSH_INTERVAL_SECONDS`` (the first token at once: it is the one a
user waits for). Each flush also renews the lease and reads the cancel flag,
so a lost lease takes the request out of the batch at the next decoding step
after the flush; an announced cancel does before the next step
(``cancellation``). A worker runs several of these at once, one per
Celery thread, all feeding the same engine; flushes that arrive together
are written together (``flushing``).
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.utils import timezone

from engine.client import engine_for
from engine.detokenizer import IncrementalDetokenizer
from engine.interface import (
    Constraint,
    EngineClient,
    EngineOutput,
    EngineRequest,
    FinishReason,
    SamplingParams,
)
from generation import grammar_limits
from generation.output import OutputAssembler
from generation.params import GenerationParams
from generation.registry import declared_models
from lmsp_core import protocol
from lmsp_core.errors import problem
from lmsp_core.status import Status
from ops_app import recorders, upstream_health
from responses_app.prompting import prompt_of
from tasks_app import checkpoints, claims, endings, upstream_waits
from tasks_app.models import Task

from . import constraints, upstream
from .cancellation import cancel_watch
from .flushing import flush_group
from .loading import LoadedModel, load_model
from .upstream import UpstreamModel, load_upstream

log = logging.getLogger(__name__)

# A run that gets no token (waiting for a batch slot, or behind a long
# prefill) still flushes to notice a cancel or a lost lease, but this rarely:
# such a flush would only take CPU from the prefill it waits for.
IDLE_FLUSH_SECONDS = 0.25


class RunEnd(enum.Enum):
    """Why a run stops before its answer is complete; each is mapped once,
    in ``GenerationRun.run`` and ``_finish``, to the task's status and events."""

    CANCELLED = "cancelled"  # the user asked: the task ends cancelled
    LOST = "lost"  # the lease went to another worker: this run writes nothing more
    PREEMPTED = "preempted"  # the engine needed its memory: handed back to the queue
    UNAVAILABLE = "unavailable"  # its upstream server could not take it: handed back to wait


class RunEndFlag:
    """The first ``RunEnd`` of a run, set from its own thread, the lease
    keeper's and the cancel watch's, under one lock: a later one never
    replaces it."""

    def __init__(self, initial: RunEnd | None = None) -> None:
        self._lock = threading.Lock()
        self._end = initial

    def set(self, end: RunEnd) -> None:
        with self._lock:
            if self._end is None:
                self._end = end

    def get(self) -> RunEnd | None:
        with self._lock:
            return self._end


def worker_name() -> str:
    """This model worker as Celery, its heartbeats and its claims name it."""
    return f"models-{os.getpid()}@{socket.gethostname()}"


def run_task(
    task_id: str, worker: str | None = None, model: str | None = None, preferred: bool = False
) -> str | None:
    """Generate the fairest queued task of the job's model (``model``, else
    ``task_id``'s: a job is a slot for its model, see ``claims.claim``) to
    its end, or ``task_id`` itself when the job was sent to this worker for
    it (``preferred``: a conversation's next turn); returns its final
    status, or None when there was nothing to do or the task was handed on."""
    task = claims.claim(
        task_id, worker or worker_name(), model, preferred=task_id if preferred else None
    )
    if task is None:
        return None
    if task.model not in declared_models():  # removed from models.toml while queued
        return GenerationRun.fail_unstarted(task, endings.model_gone_problem(task.model))
    run = GenerationRun(task)
    try:
        return run.run()
    except upstream.UpstreamRefused as exc:  # a 4xx: the upstream server's own words
        log.warning("Upstream refused %s: %s", task_id, exc)
        return run.fail(problem("generation_failed", f"The upstream server refused: {exc}"))
    except grammar_limits.GrammarError as exc:  # the web's check passed; this machine differs
        log.warning("Grammar of %s could not be compiled: %s", task_id, exc.reason)
        return run.fail(
            problem("generation_failed", f"The request's grammar cannot be compiled: {exc.reason}.")
        )
    except Exception as exc:
        log.exception("Generation of %s failed", task_id)
        return run.fail(
            problem("generation_failed", f"Generation failed: {exc.__class__.__name__}.")
        )


class EngineError(Exception):
    """The engine ended this run's request with an error (its text)."""


class GenerationRun:
    def __init__(self, task: Task) -> None:
        self.task_id = task.id
        self.owner_id = task.owner_id  # the prefix cache's salt: reuse within one owner
        self.attempt = task.attempt
        self.fair_key = task.fair_key
        self.response = task.response
        self.params = GenerationParams.from_json(self.response.params)
        self.spec = declared_models()[task.model]
        restored = endings.restore(task)
        self.token_ids: list[int] = restored.token_ids
        self.flushed_tokens = len(self.token_ids)  # how many the database has
        self.assembler = restored.assembler or OutputAssembler.for_generation(
            self.response.id, self.params, self.spec
        )
        self.offsets = restored.detokenizer
        self.pending: list[tuple[str, dict[str, Any]]] = []
        self.events_flushed = False  # by this attempt
        # Read under the claim's lock: a cancel before the start needs no flush.
        self.end = RunEndFlag(RunEnd.CANCELLED if task.cancel_requested else None)
        self.unavailable = ""  # why the upstream server could not take it
        self.waited = task.waiting_since is not None  # for its upstream server, until now
        self.ended_by_model = False
        self.ended_by_grammar = False  # complete, but the token limit came before the end token
        self.cached_tokens = 0  # prompt tokens this attempt took from the engine's prefix cache
        self.worker_seconds = 0.0  # this attempt's time in the engine, for usage
        # LMSP_MAX_JOB_SECONDS from the task's first start, over all attempts.
        self.deadline = (task.started_at or timezone.now()) + timedelta(
            seconds=settings.LMSP_MAX_JOB_SECONDS
        )
        self.past_deadline = False

    def run(self) -> str | None:
        # The lease is kept from the claim on: loading the model (a worker's
        # first task) can take longer than the lease.
        with self._lease_kept():
            lm = load_upstream(self.spec) if self.spec.upstream else load_model(self.spec)
            detok = IncrementalDetokenizer(lm.tokenizer, **self.offsets)
            remaining = self.params.max_output_tokens - len(self.token_ids)
            if self.end.get() is None and remaining > 0 and not self._past_deadline():
                prompt = prompt_of(self.response, self.spec)  # the conversation as it stands
                prompt_ids = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
                self._decode(lm, detok, prompt_ids, remaining)
        self.ended_by_grammar = not self.ended_by_model and constraints.ended(
            lm, self.params, self.token_ids
        )
        end = self.end.get()
        if end is RunEnd.LOST:
            log.warning("Task %s attempt %s was handed on; stopping", self.task_id, self.attempt)
            return None
        if end is RunEnd.PREEMPTED:
            # What the detokenizer holds back stays held: the next attempt
            # resumes from this checkpoint as if nothing happened.
            log.info("Task %s attempt %s preempted; handed back", self.task_id, self.attempt)
            checkpoints.hand_back(self._progress(detok), self.worker_seconds)
            return None
        if end is RunEnd.UNAVAILABLE:
            upstream_spec = self.spec.upstream
            assert upstream_spec is not None  # only an upstream model's server is unavailable
            log.warning("Upstream of %s unavailable: %s", self.spec.id, self.unavailable)
            upstream_health.record(self.spec.id, self.unavailable)
            waiting = upstream_waits.Waiting(
                self.unavailable,
                upstream_spec.unavailable_timeout_seconds,
                upstream_spec.retry_seconds,
            )
            checkpoints.hand_back(self._progress(detok), self.worker_seconds, waiting)
            return None
        self.pending += self.assembler.feed(detok.rest(self.token_ids))
        return self._finish()

    def _decode(
        self,
        lm: LoadedModel | UpstreamModel,
        detok: IncrementalDetokenizer,
        prompt_ids: list[int],
        remaining: int,
    ) -> None:
        """Generate in the model's batch, beside whatever else this worker runs.

        The engine thread only decodes; this job's thread turns the tokens into
        events and writes them, so a slow flush never holds up the batch. A
        flush also runs when no token came for ``IDLE_FLUSH_SECONDS`` (the
        request may wait for a batch slot), so a cancel is noticed then too.
        """
        client, request = self._request(lm, prompt_ids, remaining)
        request_id = request.request_id
        submitted_at = time.monotonic()
        stream = client.submit(request)
        interval = settings.LMSP_FLUSH_INTERVAL_SECONDS
        stack, counted = ExitStack(), False

        def cancelled_now() -> None:  # called from the cancel watch's thread
            self.end.set(RunEnd.CANCELLED)
            client.abort(request_id)

        stack.enter_context(cancel_watch.watching(self.task_id, cancelled_now))
        # Counts and times the tokens for /metrics; a resumed answer has no first token.
        timer = recorders.TokenTimer(
            self.spec.id, None if self.token_ids else self.response.created_at
        )
        last: EngineOutput | None = None
        try:
            for outputs in stream.outputs(poll=IDLE_FLUSH_SECONDS):
                # [] after IDLE_FLUSH_SECONDS without a token: flushed all the same
                due = flush_group.due(interval) or not outputs
                tokens = [(t, output.made_at) for output in outputs for t in output.new_token_ids]
                last = outputs[-1] if outputs else last
                for token_id, made_at in tokens:
                    timer.tick(made_at)
                    if not counted:  # in the batch now: its flushes are grouped
                        stack.enter_context(flush_group.decoding())
                        counted = True
                        if self.waited:  # its upstream server answers again
                            upstream_waits.recovered(self.task_id, self.attempt)
                            upstream_health.record(self.spec.id, None)
                    if token_id in lm.eos_token_ids:
                        self.ended_by_model = True
                    else:
                        self.token_ids.append(token_id)
                        self.pending += self.assembler.feed(detok.step(self.token_ids))
                        # The first event a user sees goes out at once.
                        due = due or (not self.events_flushed and bool(self.pending))
                if due:
                    self._flush(detok)
                if self.end.get() is not None or self._past_deadline():
                    return
                if self.events_flushed:  # the tokens until the next flush wait in the stream
                    stream.hold(flush_group.next_due(interval))
        finally:
            client.abort(request_id)  # leaves the batch at its next step; no-op once finished
            stack.close()
            timer.push()
            # A resume's prompt holds the tokens generated before it: only the prompt's count.
            cached = last.cached_tokens if last is not None else 0
            self.cached_tokens = min(cached, len(prompt_ids))
            self.worker_seconds = time.monotonic() - submitted_at
        finish = last.finish_reason if last is not None else None
        if finish is FinishReason.ERROR and isinstance(lm, UpstreamModel):
            raise upstream.UpstreamRefused(last.error if last else "the upstream server failed")
        if finish is FinishReason.ERROR:
            raise EngineError(last.error if last and last.error else "The engine failed.")
        if finish is FinishReason.UNAVAILABLE:  # down, or answering 5xx / 429: wait for it
            self.unavailable = last.error if last and last.error else "the server is unavailable"
            self.end.set(RunEnd.UNAVAILABLE)
        if finish is FinishReason.PREEMPTED:
            self.end.set(RunEnd.PREEMPTED)

    def _request(
        self, lm: LoadedModel | UpstreamModel, prompt_ids: list[int], remaining: int
    ) -> tuple[EngineClient, EngineRequest]:
        """The engine that generates for the model, and this attempt's request:
        the prompt and the tokens generated so far, so that it goes on from
        exactly there."""
        request_id = f"{self.task_id}:{self.attempt}"
        sampling = SamplingParams(max_tokens=remaining, temperature=self.params.temperature)
        if isinstance(lm, UpstreamModel):  # another server generates; same interface
            return upstream.upstream_engine(lm.spec), upstream.request_for(
                lm, request_id, prompt_ids, sampling,
                generated_ids=self.token_ids, params=self.params, priority=self.fair_key,
                owner_id=self.owner_id, response_id=self.response.id,
            )  # fmt: skip
        batching = engine_for(lm, self.spec.max_batch)
        tag = constraints.structural_tag_of(lm, self.params)
        constraint = None
        if tag is not None:  # its source, and compiled for the own engine
            constraint = Constraint(tag, constraints.compiled_grammar(lm, self.params))
        return batching, EngineRequest(
            request_id,
            (*prompt_ids, *self.token_ids),
            sampling,
            constraint=constraint,
            resumed_tokens=len(self.token_ids),
            priority=self.fair_key,  # the engine admits waiting requests in the fair order
            cache_salt=batching.owner_salt(self.owner_id),
        )

    def _past_deadline(self) -> bool:
        """Whether the job has run ``LMSP_MAX_JOB_SECONDS``: it then ends
        ``incomplete`` (reason ``max_job_seconds``) with what it has, as at the
        token limit; the broker's visibility timeout is set above it."""
        if not self.past_deadline and timezone.now() >= self.deadline:
            self.past_deadline = True
        return self.past_deadline

    @contextmanager
    def _lease_kept(self) -> Iterator[None]:
        """Renew the lease from a thread while the model works: a long prompt's
        first step, or a machine under load, can outlast the lease between two
        flushes, and only a dead worker should lose its task."""
        done = threading.Event()

        def keep() -> None:
            try:
                while not done.wait(settings.LMSP_LEASE_SECONDS / 3):
                    if not claims.renew_lease(self.task_id, self.attempt):
                        self.end.set(RunEnd.LOST)
                        return
            finally:
                connection.close()  # this thread's own connection

        keeper = threading.Thread(target=keep, name=f"lease-{self.task_id}", daemon=True)
        keeper.start()
        try:
            yield
        finally:
            done.set()
            keeper.join()

    def _progress(self, detok: IncrementalDetokenizer) -> checkpoints.Flush:
        """The events and tokens since the last flush, with the checkpoint they lead to."""
        checkpoint = {
            "tokens": len(self.token_ids),
            "detokenizer": detok.offsets(),
            "assembler": self.assembler.compact_state(),
        }
        new_token_ids = self.token_ids[self.flushed_tokens :]
        return checkpoints.Flush(
            self.task_id, self.attempt, self.pending, new_token_ids, checkpoint
        )

    def _flush(self, detok: IncrementalDetokenizer) -> None:
        progress = flush_group.write(self._progress(detok))
        self.flushed_tokens = len(self.token_ids)
        self.events_flushed = self.events_flushed or bool(self.pending)
        self.pending = []
        if not progress.owned:
            self.end.set(RunEnd.LOST)
        elif progress.cancel_requested:
            self.end.set(RunEnd.CANCELLED)

    def _usage(self) -> dict[str, Any]:
        generated = len(self.token_ids) + (1 if self.ended_by_model else 0)
        return protocol.usage(self.response.input_tokens, generated, self.cached_tokens)

    def _finish(self) -> str | None:
        rid, usage = self.response.id, self._usage()
        incomplete = None
        if self.end.get() is RunEnd.CANCELLED:
            status = Status.CANCELLED
            events = self.assembler.close() + [protocol.cancelled_event(rid, usage)]
        elif self.ended_by_model or self.ended_by_grammar:
            status = Status.COMPLETED
            events = self.assembler.finish() + [protocol.completed_event(rid, usage)]
        else:
            status = Status.INCOMPLETE
            reason = "max_job_seconds" if self.past_deadline else "max_output_tokens"
            incomplete = {"reason": reason}
            events = self.assembler.close() + [
                protocol.incomplete_event(rid, incomplete["reason"], usage)
            ]
        outcome = endings.Outcome(
            status=status,
            output=self.assembler.items,
            output_tokens=usage["output_tokens"],
            cached_tokens=self.cached_tokens,
            worker_seconds=self.worker_seconds,
            incomplete_details=incomplete,
        )
        return (
            status
            if endings.finish(self.task_id, self.attempt, self.pending + events, outcome)
            else None
        )

    @staticmethod
    def fail_unstarted(task: Task, error: dict[str, Any]) -> str | None:
        """Fail a claimed task before any generation (nothing to keep)."""
        events = [protocol.failed_event(task.response_id, error)]
        outcome = endings.Outcome(status=Status.FAILED, error=error)
        ok = endings.finish(task.id, task.attempt, events, outcome)
        return Status.FAILED if ok else None

    def fail(self, error: dict[str, Any]) -> str | None:
        events = self.pending + self.assembler.close()
        events.append(protocol.failed_event(self.response.id, error))
        outcome = endings.Outcome(
            status=Status.FAILED,
            output=self.assembler.items,
            output_tokens=len(self.token_ids),
            cached_tokens=self.cached_tokens,
            worker_seconds=self.worker_seconds,
            error=error,
        )
        ok = endings.finish(self.task_id, self.attempt, events, outcome)
        return Status.FAILED if ok else None
