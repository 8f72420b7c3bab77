"""The engine core: one step of the whole engine, on the caller's thread.

Why a core apart from the client (vLLM's ``EngineCore`` beside its
clients): the rules of a step (schedule, execute, update) are plain calls
that a test can drive one step at a time, while the thread, the mailbox
and the callers' handles are the client's (``client``). The core never
calls back into a caller: ``step()`` returns frozen ``StepOutput`` records,
and the client decides what each means to whoever holds the request.

The core is three parts, as vLLM's is: the scheduler (``scheduler``, plain
Python) decides what each step computes and what memory each request holds;
the model runner (``model_runner``) computes it and samples; this module
turns their results into outputs. Not thread-safe: one thread drives it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

from .decoder import Decoder
from .interface import FinishReason
from .model_runner import ModelRunner, RowSampling
from .request import Request, RequestStatus
from .scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    """What a step did to one request: the token it sampled (None when it
    ended without one), and, once it has ended, why (``error`` when it
    failed). ``cached_tokens``: its prompt tokens taken from the prefix
    cache."""

    request_id: int
    token_id: int | None
    finish_reason: FinishReason | None
    cached_tokens: int = 0
    error: BaseException | None = None


class EngineCore:
    """The scheduler and the model runner of one model, stepped by ``step()``."""

    def __init__(
        self,
        decoder: Decoder,
        max_batch: int,
        token_budget: int,
        chunk_tokens: int,
        prefix_cache: bool = True,
        slot_tokens: int = 0,
    ) -> None:
        self.scheduler = Scheduler(
            max_batch=max_batch,
            token_budget=token_budget,
            chunk_tokens=chunk_tokens,
            prefix_cache=prefix_cache,
        )
        self.runner = ModelRunner(decoder, max_batch, slot_tokens)
        self._requests: dict[int, Request] = {}  # not yet ended, by id

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, request: Request, sampling: RowSampling) -> None:
        """Queue ``request``; the runner samples it as ``sampling`` says."""
        self._requests[request.id] = request
        self.runner.add(request.id, sampling)
        self.scheduler.add(request)

    def abort(
        self, request_id: int, status: RequestStatus, error: BaseException | None = None
    ) -> StepOutput | None:
        """End a request now with a finished ``status``; its last output, or
        None when it had ended already."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.scheduler.abort(request, status, error)
        return self._output(request, None)

    def abort_all(self, status: RequestStatus) -> list[StepOutput]:
        """End every request (preempted by a draining worker, cancelled by a close)."""
        return [
            output
            for request_id in list(self._requests)
            if (output := self.abort(request_id, status)) is not None
        ]

    def forget(self, salts: Collection[str] | None) -> None:
        """An erasure (``Scheduler.forget``), before the next step."""
        self.scheduler.forget(salts)

    def step(self) -> list[StepOutput]:
        """Schedule, execute, update: one step, and what it did to each
        request it touched, in the plan's order."""
        plan = self.scheduler.schedule()
        outputs = [self._output(self._requests[request_id], None) for request_id in plan.ended]
        if not plan.chunks:
            # Nothing admitted can wait on memory with nothing running: a
            # prompt larger than the whole budget fails instead. What ended
            # meanwhile still moves its memory (a request cancelled alone
            # leaves its prefix in the cache, which the next request with
            # that prefix adopts).
            self.runner.apply(plan.memory_ops)
            return outputs
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # the model itself failed: every row shares that fate
            log.exception("Step failed for %d requests", len(plan.chunks))
            for chunk in plan.chunks:
                output = self.abort(chunk.request_id, RequestStatus.FAILED, exc)
                if output is not None:
                    outputs.append(output)
            return outputs
        for request in self.scheduler.update(plan, result.sampled, result.failed):
            outputs.append(self._output(request, result.sampled.get(request.id)))
        return outputs

    def _output(self, request: Request, token_id: int | None) -> StepOutput:
        reason = request.status.finish_reason
        if reason is not None:
            del self._requests[request.id]
            self.runner.remove(request.id)
        error = request.error if reason is not None else None
        return StepOutput(request.id, token_id, reason, request.cached_tokens, error)
