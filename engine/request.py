"""A request inside the engine and its status: the scheduler's unit, in
plain Python.

Why a module of its own: the scheduler moves requests through their
statuses, the core reports them, and the client ends its callers' handles
by them; each reads the one status here and its one map onto the
interface's ``FinishReason``, instead of a vocabulary of its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .interface import FinishReason


class RequestStatus(enum.Enum):
    """Where a request is; a finished one's ``finish_reason`` is what its caller sees."""

    WAITING = "waiting"  # not admitted: holds no memory
    PREFILLING = "prefilling"  # admitted; its prompt is computed chunk by chunk
    DECODING = "decoding"  # one token a step
    FINISHED_EOS = "eos"  # the model ended it
    FINISHED_LENGTH = "length"  # max_new_tokens reached
    FINISHED_STOPPED = "stopped"  # its caller asked
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"  # its memory was needed: to be resumed elsewhere or later
    FAILED = "error"

    @property
    def finished(self) -> bool:
        return self not in _UNFINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The caller's name for why it ended (None while unfinished)."""
        return FINISH_REASONS.get(self)


_UNFINISHED = frozenset({RequestStatus.WAITING, RequestStatus.PREFILLING, RequestStatus.DECODING})


# The one translation of the scheduler's statuses into the interface's reasons.
FINISH_REASONS = {
    RequestStatus.FINISHED_EOS: FinishReason.EOS,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_STOPPED: FinishReason.STOPPED,
    RequestStatus.CANCELLED: FinishReason.CANCELLED,
    RequestStatus.PREEMPTED: FinishReason.PREEMPTED,
    RequestStatus.FAILED: FinishReason.ERROR,
}


@dataclass(eq=False)
class Request:
    """One generation inside the engine.

    ``prompt_ids`` is everything fed before the first token sampled here:
    the prompt, and the tokens an earlier attempt generated (a resume).
    ``num_computed`` counts the tokens whose keys and values the model
    runner holds for it; ``cached_tokens`` how many of those came from the
    prefix cache. How its tokens are sampled (temperature, grammar) is the
    model runner's, by id (``model_runner.RowSampling``). ``cache_salt``: it reuses, and
    shares, keys and values only with requests of the same salt; once
    ``cacheable`` is off (an erasure named its salt), nothing it computed is
    shared or kept.
    """

    id: int
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    priority: int = 0  # lower is admitted first (the task's fair key), then arrival
    cache_salt: str = ""
    cacheable: bool = True
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0
    error: BaseException | None = None

    @property
    def reserved(self) -> int:
        """Tokens this request holds room for once admitted: its prompt whole,
        and every token generated (the last one is fed at the next step)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]
