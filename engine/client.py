"""The engine client: the thread that steps the own engine's core, the
handles its callers hold, and this process's engines, behind the small
interface every engine shares (``interface.EngineClient``).

Why continuous batching: a worker that runs one ``model.generate`` at a
time leaves most of the hardware idle; decoding 8 sequences in one forward
pass costs little more than decoding one (about 5x the aggregate tokens/s
on the 2-core CPU, far more on a GPU). A static batch would make a new
request wait until the whole batch drains, so the batch is planned again at
every step instead (iteration-level, or continuous, batching): a request
joins at the next step and leaves as soon as it ends.

Why a client apart from the core (``core``, vLLM's split): the core steps
in plain calls and returns frozen outputs; this module owns everything that
is about threads and callers: the mailbox that hands it requests, cancels,
erasures and drains between two steps, the ``Generation`` each caller
holds, the thread counts of its steps (``share_cores``), and the one engine
per model of this process (``engine_for``).

Each request is salted with its owner (``owner_salt``): the prefix cache
reuses keys and values only within one owner, unless the model's
``share_prefix_cache`` says otherwise (then every request has the same
salt). ``forget`` is how an erasure reaches the cache: the engine thread
itself drops the entries, between two steps.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import xgrammar as xgr

from .core import EngineCore, StepOutput
from .decoder import Decoder
from .interface import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    OutputQueue,
    SamplingParams,
)
from .model_runner import ModelRunner, RowSampling
from .request import Request, RequestStatus
from .scheduler import Scheduler, SchedulerStats

log = logging.getLogger(__name__)

TokenCallback = Callable[[int], "bool | None"]


class ModelSettings(Protocol):
    """What the engine reads of a model's entry (``generation.registry.ModelSpec``)."""

    @property
    def id(self) -> str: ...

    @property
    def prefix_cache(self) -> bool: ...

    @property
    def share_prefix_cache(self) -> bool: ...

    @property
    def context_window(self) -> int: ...


class ServedModel(Protocol):
    """A model loaded for an engine (``workers.loading.LoadedModel``): its
    forward pass, end tokens, and the memory and threads its engine may use."""

    @property
    def spec(self) -> ModelSettings: ...

    @property
    def decoder(self) -> Decoder: ...

    @property
    def eos_token_ids(self) -> Collection[int]: ...

    @property
    def token_budget(self) -> int: ...

    @property
    def chunk_tokens(self) -> int: ...

    @property
    def threads(self) -> int: ...


class Generation:
    """One submitted request, as its caller holds it: the own engine's
    ``OutputStream`` (``interface``).

    ``token_ids`` are the tokens this engine generated for it (an end token
    included when the model chose one), ``finish_reason`` is set once it has
    left the engine (``interface.FinishReason``); with ``ERROR``, ``error``
    holds the exception (only this request is affected). ``PREEMPTED``: its
    memory was needed by requests admitted before it, or the engine is
    draining; the caller resumes it later, from its tokens so far.
    """

    def __init__(self, request_id: str, streamed: bool) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.error: BaseException | None = None
        self.cached_tokens = 0  # prompt tokens taken from the prefix cache
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._cancel_requested = False
        self._finished = threading.Event()
        self._outputs = OutputQueue() if streamed else None

    def cancel(self) -> None:
        """Ask the engine to drop this request; takes effect before its next token.

        Safe from any thread; a no-op once it has finished.
        """
        self._cancel_requested = True

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request has left the engine; False on timeout."""
        return self._finished.wait(timeout)

    def outputs(self, poll: float) -> Iterator[list[EngineOutput]]:
        """Its outputs as they come (for requests submitted without
        ``on_token``), one per token and a last one that finishes it, in
        lists of those that came together, and [] whenever ``poll`` seconds
        pass without one, so that the caller can do its own work between
        tokens (``interface.OutputStream``)."""
        return self._queue().outputs(poll)

    def hold(self, until: float) -> None:
        self._queue().hold(until)

    def _queue(self) -> OutputQueue:
        if self._outputs is None:
            raise RuntimeError("This request delivers its tokens to its on_token callback.")
        return self._outputs

    def stream(self, timeout: float | None = None) -> Iterator[int]:
        """The tokens one by one as they come (only for requests submitted without
        ``on_token``); ends when the request has finished. ``timeout`` bounds the
        wait for each token (``queue.Empty`` past it)."""
        for outputs in self.outputs(poll=timeout if timeout is not None else 3600.0):
            if not outputs and timeout is not None:
                raise queue.Empty
            for output in outputs:
                yield from output.new_token_ids

    # --- called on the engine thread -----------------------------------------------

    def _deliver(self, token_id: int, on_token: TokenCallback | None) -> bool:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.token_ids.append(token_id)
        if on_token is None:
            assert self._outputs is not None
            self._outputs.put(EngineOutput(self.request_id, (token_id,), None, self.cached_tokens))
            return False
        return bool(on_token(token_id))

    def _finish(self, reason: FinishReason, error: BaseException | None = None) -> None:
        if self._finished.is_set():
            return
        self.finish_reason = reason
        self.error = error
        self.finished_at = time.monotonic()
        if self._outputs is not None:
            text = None if error is None else str(error) or error.__class__.__name__
            self._outputs.put(EngineOutput(self.request_id, (), reason, self.cached_tokens, text))
        self._finished.set()


@dataclass(frozen=True)
class EngineStats:
    """What an engine holds now, and its counts since it started (``/metrics``)."""

    token_budget: int
    reserved_tokens: int  # the running requests'
    cached_tokens: int  # the prefix cache's
    cache_entries: int
    running: int
    waiting: int
    counts: SchedulerStats
    # Tokens the tensors of keys and values have room for (grown in steps), and their peak.
    allocated_tokens: int
    peak_allocated_tokens: int

    @property
    def held_tokens(self) -> int:
        return self.reserved_tokens + self.cached_tokens


class BatchingEngine:
    """Runs up to ``max_batch`` generations of one model at once, on one thread,
    within ``token_budget`` tokens of keys and values (running requests and
    the prefix cache together), computing prompts ``chunk_tokens`` at a time.

    ``submit`` (the interface's) and ``add_request`` (with the own engine's
    extras) queue a request and return its ``Generation`` at once; the
    request is admitted before the next decoding step if its prompt fits in
    the budget (else it waits, in ``priority`` order). For every token it
    samples, the engine calls ``on_token(token_id)`` on the engine thread
    (end tokens included, as ``tests.reference.generate`` does); a truthy
    return ends that request (``stopped``). Without ``on_token`` the tokens
    go to ``Generation.outputs()``. Callbacks must be quick: every row of the
    batch waits for them. An exception in one is logged and ends only that
    request (``error``). ``Generation.cancel()`` (or ``abort``) drops the
    request before its next token. ``close()`` stops the thread and cancels
    whatever is left. ``share_prefix_cache`` (default: the model's setting)
    lets requests of different owners reuse each other's prefixes.
    """

    def __init__(
        self,
        lm: ServedModel,
        max_batch: int = 8,
        token_budget: int | None = None,
        chunk_tokens: int | None = None,
        prefix_cache: bool | None = None,
        name: str | None = None,
        share_prefix_cache: bool | None = None,
    ) -> None:
        spec = lm.spec
        self.lm = lm
        self.max_batch = max_batch
        self.share_prefix_cache = (
            spec.share_prefix_cache if share_prefix_cache is None else share_prefix_cache
        )
        self.default_eos = frozenset(lm.eos_token_ids)
        self.core = EngineCore(
            lm.decoder,
            max_batch=max_batch,
            token_budget=token_budget or lm.token_budget,
            chunk_tokens=chunk_tokens or lm.chunk_tokens,
            prefix_cache=spec.prefix_cache if prefix_cache is None else prefix_cache,
            # The service holds a request within its model's context window (a
            # longer one, within the budget, still runs: its slot grows by copying).
            slot_tokens=min(spec.context_window, token_budget or lm.token_budget),
        )
        self._threads = lm.threads  # OpenMP threads of its steps (0: torch's own count)
        self._ids = itertools.count(1)
        self._inbox: collections.deque[tuple[Request, RowSampling]] = collections.deque()
        # Salts to forget (None: every entry), in the order erasures came.
        self._forget: list[frozenset[str] | None] = []
        self._generations: dict[int, tuple[Generation, TokenCallback | None]] = {}
        self._by_request_id: dict[str, Generation] = {}  # the callers' ids (abort)
        self._wakeup = threading.Condition()
        self._closing = False
        self._draining = False
        self._sharing_cores = False  # asked for (share_cores)
        self._cores_shared = False  # done, on the engine thread
        # The process's thread count, read here because the engine thread
        # changes its own (lm.threads, share_cores).
        self._process_threads = torch.get_num_threads()
        self._thread = threading.Thread(
            target=self._loop, name=name or f"batching-{spec.id}", daemon=True
        )
        self._thread.start()

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def token_budget(self) -> int:
        return self.scheduler.token_budget

    def owner_salt(self, owner_id: int) -> str:
        """The cache salt of an owner's requests: their own, unless this
        model's cache is shared."""
        return "" if self.share_prefix_cache else f"owner:{owner_id}"

    # --- the callers' side -----------------------------------------------------------

    def submit(self, request: EngineRequest) -> Generation:
        """Queue ``request`` (``interface.EngineClient.submit``); thread-safe.

        Its constraint must carry its compiled grammar: this engine masks
        logits itself. It samples by temperature alone (``top_p`` 1, no
        ``seed``), and refuses other settings."""
        sampling = request.sampling
        if sampling.top_p != 1.0 or sampling.seed is not None:
            raise ValueError("This engine samples by temperature alone (top_p 1, no seed).")
        constraint = request.constraint
        if constraint is not None and not isinstance(constraint.compiled, xgr.CompiledGrammar):
            raise ValueError("This engine needs the constraint's compiled grammar.")
        ids = request.prompt_token_ids
        cut = len(ids) - request.resumed_tokens
        return self.add_request(
            ids[:cut],
            sampling,
            generated_ids=ids[cut:],
            grammar=None if constraint is None else constraint.compiled,
            priority=request.priority,
            cache_salt=request.cache_salt,
            request_id=request.request_id,
        )

    def abort(self, request_id: str) -> None:
        """End a request before its next token (``interface.EngineClient.abort``)."""
        with self._wakeup:
            generation = self._by_request_id.get(request_id)
        if generation is not None:
            generation.cancel()

    def add_request(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        on_token: TokenCallback | None = None,
        *,
        generated_ids: Sequence[int] = (),
        grammar: xgr.CompiledGrammar | None = None,
        eos_token_ids: Iterable[int] | None = None,
        priority: int = 0,
        cache_salt: str = "",
        request_id: str | None = None,
    ) -> Generation:
        """Queue one generation; thread-safe.

        ``generated_ids`` are tokens an earlier attempt already produced
        (resume): they are fed after the prompt, the grammar's matcher first
        accepts them, and ``sampling.max_tokens`` counts only new tokens.
        ``grammar`` (from ``workers.constraints.compiled_grammar``) constrains
        every sampled token. ``eos_token_ids`` default to the model's.
        Waiting requests are admitted in ``priority`` order (lower first),
        then in the order they came. ``cache_salt`` (``owner_salt``): it
        reuses prefixes only of requests with the same salt. ``request_id``
        (default: a number of the engine's) is the name ``abort`` takes.
        """
        eos = frozenset(eos_token_ids) if eos_token_ids is not None else self.default_eos
        request = Request(
            id=next(self._ids),
            prompt_ids=[*prompt_ids, *generated_ids],
            max_new_tokens=sampling.max_tokens,
            eos_token_ids=eos,
            priority=priority,
            cache_salt=cache_salt,
        )
        if not request.prompt_ids:
            raise ValueError("A generation needs at least one prompt token.")
        row = RowSampling(sampling.temperature, grammar, list(generated_ids), eos)
        name = request_id if request_id is not None else str(request.id)
        generation = Generation(name, streamed=on_token is None)
        with self._wakeup:
            if self._closing:
                raise RuntimeError("The engine is closed.")
            self._generations[request.id] = (generation, on_token)
            self._by_request_id[name] = generation
            self._inbox.append((request, row))
            self._wakeup.notify()
        return generation

    @property
    def running(self) -> int:
        """Generations admitted now (prefilling or decoding)."""
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    @property
    def closed(self) -> bool:
        return self._closing

    def stats(self) -> EngineStats:
        """A snapshot; safe from any thread (its figures may be a step apart)."""
        scheduler = self.scheduler
        cache = scheduler.cache
        return EngineStats(
            token_budget=scheduler.token_budget,
            reserved_tokens=scheduler.reserved_tokens,
            cached_tokens=scheduler.cached_tokens,
            cache_entries=len(cache) if cache is not None else 0,
            running=self.running,
            waiting=self.waiting,
            counts=SchedulerStats(**vars(scheduler.stats)),
            allocated_tokens=self.runner.memory.allocated_tokens,
            peak_allocated_tokens=self.runner.memory.peak_allocated_tokens,
        )

    def forget(self, owner_ids: Collection[int] | None) -> None:
        """Text of these owners was erased (None: of anyone): drop their
        prefix-cache entries (every entry, when this model's cache is shared),
        and keep nothing of their requests now in the engine, before the next
        step; thread-safe."""
        salts = (
            None
            if owner_ids is None or self.share_prefix_cache
            else frozenset(map(self.owner_salt, owner_ids))
        )
        with self._wakeup:
            self._forget.append(salts)
            self._wakeup.notify()

    def drain(self) -> None:
        """Preempt every generation at the next step, and every one submitted
        after: the worker is stopping. Each ends ``preempted``, and its caller
        hands it back to the queue, from its tokens so far, for another worker."""
        with self._wakeup:
            self._draining = True
            self._wakeup.notify()

    def share_cores(self) -> None:
        """Run the next steps on at most half the machine's threads (at least
        one): a worker told to stop
        keeps generating while its successor starts, often on the same
        machine, and every stream it hands over waits for that start
        (imports, weights), which steps on every core slowed by half (9.2 s
        instead of 13.0 beside a one-thread rather than a two-thread load, on
        the 2-core CPU). Thread counts are per thread: the engine's own sets
        it."""
        with self._wakeup:
            self._sharing_cores = True
            self._wakeup.notify()

    def close(self, timeout: float | None = None) -> None:
        """Stop the engine thread after its current step; unfinished requests end
        as ``cancelled``."""
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        self._thread.join(timeout)

    # --- the engine thread ------------------------------------------------------------

    def _loop(self) -> None:
        core = self.core
        if self._threads:  # thread counts are per thread: the engine's own
            torch.set_num_threads(self._threads)
        with torch.inference_mode():
            while True:
                with self._wakeup:
                    while (
                        not self._closing
                        and not core.has_work
                        and not self._inbox
                        and not self._forget
                    ):
                        self._wakeup.wait()
                    if self._closing:
                        break
                    arrived = list(self._inbox)
                    self._inbox.clear()
                    forgotten, self._forget = self._forget, []
                for request, row in arrived:
                    core.add(request, row)
                for salts in forgotten:  # after the arrivals: they came before the erasure
                    core.forget(salts)
                if self._sharing_cores and not self._cores_shared:
                    half = max(1, self._process_threads // 2)
                    torch.set_num_threads(min(torch.get_num_threads(), half))
                    self._cores_shared = True
                self._abort_cancelled()
                if self._draining:
                    for output in core.abort_all(RequestStatus.PREEMPTED):
                        self._deliver(output)
                for output in core.step():
                    self._deliver(output)
            with self._wakeup:  # closed: whatever is left ends cancelled
                leftover = [request for request, _ in self._inbox]
                self._inbox.clear()
            for output in core.abort_all(RequestStatus.CANCELLED):
                self._deliver(output)
            for request in leftover:
                self._end(request.id, FinishReason.CANCELLED)

    def _abort_cancelled(self) -> None:
        for request_id, (generation, _) in list(self._generations.items()):
            if generation.cancel_requested:
                output = self.core.abort(request_id, RequestStatus.CANCELLED)
                if output is not None:
                    self._deliver(output)

    def _deliver(self, output: StepOutput) -> None:
        """Hand a step's output to its caller: its token, then its end if it
        has ended (or its caller's cancel, stop or failing callback ended it)."""
        generation, on_token = self._generations[output.request_id]
        if generation.cancel_requested:  # its token is not delivered
            self.core.abort(output.request_id, RequestStatus.CANCELLED)
            self._end(output.request_id, FinishReason.CANCELLED)
            return
        ended = output
        if output.token_id is not None:
            generation.cached_tokens = output.cached_tokens
            try:
                stop = generation._deliver(output.token_id, on_token)
            except Exception as exc:  # the caller's callback: only this request fails
                log.warning(
                    "Generation %s failed in its callback", output.request_id, exc_info=True
                )
                ended = self.core.abort(output.request_id, RequestStatus.FAILED, exc) or output
            else:
                if stop:
                    ended = (
                        self.core.abort(output.request_id, RequestStatus.FINISHED_STOPPED) or output
                    )
        if ended.finish_reason is not None:
            self._end(output.request_id, ended.finish_reason, ended.error)

    def _end(
        self, request_id: int, reason: FinishReason, error: BaseException | None = None
    ) -> None:
        generation, _ = self._generations.pop(request_id)
        with self._wakeup:
            self._by_request_id.pop(generation.request_id, None)
        generation._finish(reason, error)


_engines: dict[str, BatchingEngine] = {}
_engines_lock = threading.Lock()


def engines() -> list[BatchingEngine]:
    """This process's engines, one per model it has served."""
    with _engines_lock:
        return list(_engines.values())


def drain_all() -> None:
    """Drain every engine of this process (``BatchingEngine.drain``)."""
    for engine in engines():
        engine.drain()


def engine_for(lm: ServedModel, max_batch: int = 8) -> BatchingEngine:
    """The process's one engine for a loaded model, started on first use
    (``max_batch`` counts only then)."""
    with _engines_lock:
        running = _engines.get(lm.spec.id)
        if running is None or running.closed:
            running = _engines[lm.spec.id] = BatchingEngine(lm, max_batch=max_batch)
        return running
