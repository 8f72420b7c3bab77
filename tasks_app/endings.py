"""How a task ends: its last events, its status, its response's usage, in
one go (``finalize``), whoever ends it: its worker (``finish``), a cancel,
the sweeper, a refused claim or the loss of its model.

A task a worker cannot end (cancelled while queued, its worker lost, its
model gone) is closed from its checkpoint (``partial_outcome``): what was
generated is kept and the open output items are closed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.utils import timezone

from generation.output import TEXT_DELTA_EVENTS, OutputAssembler
from generation.registry import declared_models
from lmsp_core import protocol
from lmsp_core.errors import problem
from lmsp_core.status import Status

from . import fairness, jobs, quotas, transitions, usage
from .event_log import EventLog
from .models import Event, Task, TokenChunk
from .signals import task_finished

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """How a generation ended, as stored on the response."""

    status: str
    output: list[dict[str, Any]] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the worker's prefix cache supplied
    worker_seconds: float = 0.0  # the ending attempt's time in the engine
    error: dict[str, Any] | None = None
    input_billed: bool = True  # False: refused before any engine read it (``entitlement``)
    incomplete_details: dict[str, Any] | None = None


@dataclass(frozen=True)
class Restored:
    """Where an earlier attempt of a task stopped (nothing, for a first attempt)."""

    token_ids: list[int] = field(default_factory=list)
    detokenizer: dict[str, Any] = field(default_factory=dict)
    assembler: OutputAssembler | None = None


def _owned(task_id: str, attempt: int) -> Task | None:
    """The task, locked, while ``attempt`` is its running one; else None."""
    task = Task.objects.select_for_update().filter(id=task_id).first()
    if task is None or task.attempt != attempt or task.status != Status.IN_PROGRESS:
        return None
    return task


@transaction.atomic
def finish(
    task_id: str, attempt: int, events: list[tuple[str, dict[str, Any]]], outcome: Outcome
) -> bool:
    """Write a worker's last events and the final result; False if it lost the task."""
    task = _owned(task_id, attempt)
    if task is None:
        return False
    finalize(task, events, outcome)
    return True


def finalize(task: Task, events: list[tuple[str, dict[str, Any]]], outcome: Outcome) -> None:
    """Close a locked task: its last events, its status, its response's
    (``transitions.move_response``) and outcome (``task_finished``), and its
    usage (``usage.end``), in one go."""
    now = timezone.now()
    EventLog.append(task, events)
    task.status = outcome.status
    task.error = outcome.error
    task.completed_at = now
    task.lease_expires_at = None
    task.checkpoint = None
    task.save()
    transitions.move_response(task)
    TokenChunk.objects.filter(task=task).delete()
    fairness.forget_position(task.id)
    task_finished.send(sender=Task, task=task, outcome=outcome)
    usage.end(
        task.response_id,
        outcome.status,
        output_tokens=outcome.output_tokens,
        cached_tokens=outcome.cached_tokens,
        worker_seconds=outcome.worker_seconds,
        now=now,
        input_billed=outcome.input_billed,
    )
    _resend_held_back(task.owner_id)


def _resend_held_back(owner_id: int) -> None:
    """A claim that passed over an owner at its running quota used up its
    message; once one of the owner's generations ends, send a slot for each
    model it still has tasks waiting for (a spare message claims nothing)."""
    if not quotas.limits_for(owner_id).max_running:
        return
    waiting = Task.objects.filter(owner_id=owner_id, status=Status.QUEUED)
    for model, task_id in waiting.order_by("model").distinct("model").values_list("model", "id"):
        jobs.enqueue_on_commit_id(task_id, model, declared_models()[model].queue)


def restore(task: Task) -> Restored:
    """What a task's checkpoint stands for: its token ids (from the chunks, up to
    the checkpoint's count) and its output assembler (text put back from the log)."""
    checkpoint = task.checkpoint
    if not checkpoint:
        return Restored()
    token_ids = [
        token_id
        for chunk in TokenChunk.objects.filter(task=task).order_by("start")
        for token_id in chunk.token_ids
    ][: checkpoint["tokens"]]
    deltas = Event.objects.filter(task=task, type__in=TEXT_DELTA_EVENTS).order_by("seq")
    assembler = OutputAssembler.restore(
        task.response_id,
        checkpoint["assembler"],
        ((event.type, json.loads(event.data)) for event in deltas.only("type", "data")),
    )
    return Restored(token_ids, checkpoint["detokenizer"], assembler)


def partial_outcome(
    task: Task, status: str, error: dict[str, Any] | None = None
) -> tuple[list[tuple[str, dict[str, Any]]], Outcome]:
    """Close what a worker left open (its checkpoint) when the worker cannot."""
    restored = restore(task)
    assembler = restored.assembler or OutputAssembler(task.response_id)
    events = assembler.close()
    usage = protocol.usage(task.response.input_tokens, len(restored.token_ids))
    if status == Status.CANCELLED:
        events.append(protocol.cancelled_event(task.response_id, usage))
    else:
        assert error is not None  # a failure has its problem
        events.append(protocol.failed_event(task.response_id, error))
    outcome = Outcome(
        status=status,
        output=assembler.items,
        output_tokens=usage["output_tokens"],
        error=error,
    )
    return events, outcome


def model_gone_problem(model: str) -> dict[str, Any]:
    """The error of a task whose model was removed from ``models.toml`` while
    the task waited: no worker will ever serve it."""
    return problem(
        "generation_failed",
        f"The model {model!r} is no longer served here (it was removed from the model "
        "registry); the task cannot run.",
        model=model,
    )


def fail_model_gone(task: Task) -> None:
    """Fail a locked task whose model is gone, keeping what it generated."""
    log.warning("Task %s needs the model %r, which is gone; failing it", task.id, task.model)
    finalize(task, *partial_outcome(task, Status.FAILED, model_gone_problem(task.model)))
