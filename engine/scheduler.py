"""The batching engine's scheduler: which requests take part in the next
decoding step, with how many of their tokens, and what happens to the
memory that holds their keys and values.

Why a scheduler of its own (vLLM's engine core is split the same way): the
rules of a serving engine (admission by memory rather than by count, prompts
computed in chunks beside the decoding rows, preemption, cancels at any
stage, reuse of what was computed before) are where its bugs live, and they
are easiest to get right as plain Python tested without a model
(``tests/test_scheduler.py``). The model runner (``model_runner``) only
executes what a ``StepPlan`` says; the engine loop (``batching``) turns the
results into what each caller sees.

The memory is counted in tokens (``token_budget``): every running request
holds room for all its tokens so far (its whole prompt from admission on,
then one more per generated token), and the prefix cache holds the tokens
of its entries. A request is admitted when its prompt fits beside what is
held (cache entries are evicted for it, least recently used first); a
running request that has no room for its next token first evicts cache
entries, then preempts the request admitted last, which leaves the engine
as ``PREEMPTED`` (its caller hands it back to the task queue, and it
resumes from its checkpoint). ``max_batch`` still bounds the rows of a step.

A prompt is computed ``chunk_tokens`` at a time while other requests
decode: every step feeds each decoding row its last token, and at most
``chunk_tokens`` prompt tokens of the requests still prefilling, so a long
prompt delays the others by one chunk per step instead of its whole
prefill. With no row decoding, prompts are computed whole: a step reads
every weight of the model once whatever its tokens, so chunks would only
make a lone prompt slower (2.3x for 264 tokens in chunks of 64, measured
on the 2-core CPU).

What a finished request computed stays in the prefix cache
(``PrefixCache``): a later prompt that starts with the same tokens (the
next turn of a conversation, a shared system prompt, a resumed attempt)
copies those keys and values and computes only the rest. What a running
request has computed so far is shared the same way (``Share``): requests
that arrive while one with the same start runs (a system prompt many users
send at once; the generations a stopping worker hands to its successor, all
resumed at once) copy it instead of each computing it again, as vLLM's
prefix caching shares the blocks of running requests.

Reuse happens only between requests of one ``cache_salt`` (vLLM's name): the
worker salts each request with its owner (``batching``), so an owner never
starts from another's keys and values. Sharing them would tell the owner how
much of their prompt another had sent (the cached-token count of their
usage, their first token's time): enough to guess another's prompt one token
at a time. ``forget`` drops what an erasure names: the entries of some salts
now, and whatever the requests of those salts still in the engine computed
when they end.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .request import Request, RequestStatus

# What ends without being cached: a failure's memory may be wrong, a
# preemption's is what the others need.
_NOT_KEPT = frozenset({RequestStatus.FAILED, RequestStatus.PREEMPTED})


class BudgetExceededError(Exception):
    """A request that cannot fit in the model's token budget even alone."""


# --- what a step does ----------------------------------------------------------------


@dataclass(frozen=True)
class Adopt:
    """Copy the first ``tokens`` of cache entry ``entry_id`` into the memory of
    request ``request_id`` (made with room for ``room`` tokens), before it
    computes the rest of its prompt."""

    request_id: int
    entry_id: int
    tokens: int
    room: int


@dataclass(frozen=True)
class Share:
    """Copy the first ``tokens`` that running request ``source_id`` has
    computed into the memory of request ``request_id`` (made with room for
    ``room`` tokens), before it computes the rest of its prompt."""

    request_id: int
    source_id: int
    tokens: int
    room: int


@dataclass(frozen=True)
class Release:
    """Request ``request_id`` holds no memory any more; the keys and values of
    its first ``tokens`` tokens become cache entry ``entry_id`` (None: dropped)."""

    request_id: int
    entry_id: int | None = None
    tokens: int = 0


@dataclass(frozen=True)
class Evict:
    """Drop cache entry ``entry_id``."""

    entry_id: int


MemoryOp = Adopt | Share | Release | Evict


@dataclass(frozen=True)
class Chunk:
    """Tokens request ``request_id`` feeds in a step: ``token_ids`` at
    positions from ``start`` (of its prompt with ``prefill``, else its last
    generated token); with ``sample``, the step ends its input and its next
    token is sampled from the last one."""

    request_id: int
    start: int
    token_ids: list[int]
    sample: bool
    prefill: bool = True


@dataclass(frozen=True)
class StepPlan:
    """One step: the memory operations to apply first, in order, then the
    chunks to compute together; ``ended`` are the ids of the requests the
    scheduler finished while planning (preempted, or too large to ever fit).
    It names requests by id only: what it carries is copied, never a live
    request of the scheduler's."""

    memory_ops: list[MemoryOp]
    chunks: list[Chunk]
    ended: list[int]


@dataclass
class SchedulerStats:
    """Counts since the engine started (``/metrics`` takes the differences)."""

    prompt_tokens_computed: int = 0
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    preemptions: int = 0
    peak_held_tokens: int = 0  # the most ``held_tokens`` a planned step has had


# --- the prefix cache's index ----------------------------------------------------------


@dataclass(eq=False)
class _Entry:
    id: int
    token_ids: list[int]
    salt: str
    last_used: int


class PrefixCache:
    """Which token sequences the model runner keeps keys and values of, and
    the longest of them with the same salt a new prompt starts with.

    Entries are found through a chain of hashes over blocks of ``BLOCK``
    tokens (the scheme of vLLM's automatic prefix caching), the salt hashed
    into the first: looking a prompt up costs one dictionary lookup per
    block, whatever the number of entries, and the match is then extended
    token by token into the next block. An entry that a newer one extends (the earlier turn of a
    conversation) is dropped for it.
    """

    BLOCK = 16

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._by_chain: dict[int, set[int]] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def _chain(self, salt: str, token_ids: Sequence[int]) -> Iterable[int]:
        digest = hash(salt)
        for end in range(self.BLOCK, len(token_ids) + 1, self.BLOCK):
            digest = hash((digest, *token_ids[end - self.BLOCK : end]))
            yield digest

    def lookup(
        self, token_ids: Sequence[int], limit: int, salt: str = ""
    ) -> tuple[int, int] | None:
        """The entry of ``salt`` sharing the longest prefix (at least one block)
        with ``token_ids``, and that prefix's length, at most ``limit``."""
        candidates: set[int] = set()
        blocks = 0
        for digest in self._chain(salt, token_ids[:limit]):
            found = self._by_chain.get(digest)
            if not found:
                break
            candidates, blocks = found, blocks + 1
        best: tuple[int, int] | None = None
        start = blocks * self.BLOCK
        for entry_id in candidates:
            entry = self._entries[entry_id]
            if entry.salt != salt or entry.token_ids[:start] != list(token_ids[:start]):
                continue  # a hash collision
            end = min(limit, len(token_ids))
            length = start + _common_prefix(entry.token_ids[start:end], token_ids[start:end])
            if best is None or length > best[1]:
                best = (entry_id, length)
        return best

    def touch(self, entry_id: int) -> None:
        self._entries[entry_id].last_used = next(self._clock)

    def insert(self, token_ids: list[int], salt: str = "") -> tuple[int | None, list[int]]:
        """Keep ``token_ids`` as an entry of ``salt``; returns its id (None when
        an entry of that salt already holds them all, or they are too few to
        be found) and the ids of the entries it makes redundant, now removed."""
        if len(token_ids) < self.BLOCK:
            return None, []
        match = self.lookup(token_ids, len(token_ids), salt)
        if match is not None and match[1] == len(token_ids):
            self.touch(match[0])
            return None, []
        entry = _Entry(next(self._ids), token_ids, salt, next(self._clock))
        self._entries[entry.id] = entry
        self.tokens += len(token_ids)
        for digest in self._chain(salt, token_ids):
            self._by_chain.setdefault(digest, set()).add(entry.id)
        covered = []
        if match is not None and match[1] == len(self._entries[match[0]].token_ids):
            covered.append(match[0])
            self.remove(match[0])
        return entry.id, covered

    def remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.tokens -= len(entry.token_ids)
        for digest in self._chain(entry.salt, entry.token_ids):
            holders = self._by_chain[digest]
            holders.discard(entry_id)
            if not holders:
                del self._by_chain[digest]

    def salted(self, salts: Collection[str] | None) -> list[int]:
        """The ids of the entries of ``salts`` (None: every entry)."""
        return [e.id for e in self._entries.values() if salts is None or e.salt in salts]

    def least_recently_used(self, keep: int | None = None) -> int | None:
        entries = [entry for entry in self._entries.values() if entry.id != keep]
        if not entries:
            return None
        return min(entries, key=lambda entry: entry.last_used).id

    def size_of(self, entry_id: int) -> int:
        return len(self._entries[entry_id].token_ids)


# --- the scheduler ------------------------------------------------------------------------


class Scheduler:
    """Owns the waiting and running requests of one engine; see the module's docstring.

    ``schedule()`` plans a step, the model runner executes it, and
    ``update()`` takes what it sampled; ``abort()`` ends a request at any
    stage. Not thread-safe: the engine calls it from its own thread only.
    """

    def __init__(
        self,
        max_batch: int,
        token_budget: int,
        chunk_tokens: int,
        prefix_cache: bool = True,
    ) -> None:
        if max_batch < 1 or token_budget < 1 or chunk_tokens < 1:
            raise ValueError("max_batch, token_budget and chunk_tokens must be positive")
        self.max_batch = max_batch
        self.token_budget = token_budget
        self.chunk_tokens = chunk_tokens
        self.cache = PrefixCache() if prefix_cache else None
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in the order they were admitted
        self._requests: dict[int, Request] = {}  # the waiting and running ones, by id
        self.stats = SchedulerStats()
        self._arrivals = itertools.count()
        self._arrival: dict[int, int] = {}
        self._memory_ops: list[MemoryOp] = []

    # --- the engine's calls ----------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._requests[request.id] = request
        self._arrival[request.id] = next(self._arrivals)
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: (r.priority, self._arrival[r.id]))

    def abort(
        self, request: Request, status: RequestStatus, error: BaseException | None = None
    ) -> None:
        """End ``request`` now with a finished ``status`` (cancelled, stopped by
        its caller, failed, preempted by a draining worker); a no-op once it
        has finished."""
        if request.status.finished:
            return
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
            self._end(request, status, error)
        else:
            self._finish(request, status, error)

    def forget(self, salts: Collection[str] | None) -> None:
        """An erasure: drop the cache entries of ``salts`` (None: every entry),
        and keep nothing of what the requests of those salts now in the engine
        compute (their prompts may hold the erased words): no later request
        shares it, and it is not cached when they end."""
        for request in [*self.waiting, *self.running]:
            if salts is None or request.cache_salt in salts:
                request.cacheable = False
        if self.cache is None:
            return
        for entry_id in self.cache.salted(salts):
            self.cache.remove(entry_id)
            self._memory_ops.append(Evict(entry_id))

    def schedule(self) -> StepPlan:
        ended = self._make_room()
        ended += self._admit()
        self.stats.peak_held_tokens = max(self.stats.peak_held_tokens, self.held_tokens)
        chunks = [
            Chunk(request.id, request.num_computed, [request.output_ids[-1]], True, prefill=False)
            for request in self.running
            if request.status == RequestStatus.DECODING
        ]
        # Chunks protect the rows decoding beside a prompt; with none, a prompt
        # in chunks would only read every weight once per chunk instead of once.
        prompt_room = self.chunk_tokens if chunks else sys.maxsize
        for request in self.running:
            if request.status != RequestStatus.PREFILLING or prompt_room <= 0:
                continue
            start = request.num_computed
            end = min(len(request.prompt_ids), start + prompt_room)
            chunks.append(
                Chunk(
                    request.id, start, request.prompt_ids[start:end], end == len(request.prompt_ids)
                )
            )
            prompt_room -= end - start
        memory_ops, self._memory_ops = self._memory_ops, []
        return StepPlan(memory_ops, chunks, [request.id for request in ended])

    def update(
        self,
        plan: StepPlan,
        sampled: Mapping[int, int],
        failed: Mapping[int, BaseException] | None = None,
    ) -> list[Request]:
        """Take a step's results: the token sampled for each chunk that asked for
        one (by request id), and the requests that failed alone. Returns the
        requests that got a token or finished, in the plan's order."""
        failed = failed or {}
        changed = []
        for chunk in plan.chunks:
            request = self._requests.get(chunk.request_id)
            if request is None:  # ended since the plan was made
                continue
            if request.id in failed:
                self._finish(request, RequestStatus.FAILED, failed[request.id])
                changed.append(request)
                continue
            request.num_computed += len(chunk.token_ids)
            if chunk.prefill:
                self.stats.prompt_tokens_computed += len(chunk.token_ids)
            if not chunk.sample:
                continue
            token_id = sampled[request.id]
            request.output_ids.append(token_id)
            request.status = RequestStatus.DECODING
            if token_id in request.eos_token_ids:
                self._finish(request, RequestStatus.FINISHED_EOS)
            elif len(request.output_ids) >= request.max_new_tokens:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
            changed.append(request)
        return changed

    # --- what is held -----------------------------------------------------------------

    @property
    def held_tokens(self) -> int:
        """Tokens of memory in use: the running requests' and the cache's."""
        return self.reserved_tokens + self.cached_tokens

    @property
    def reserved_tokens(self) -> int:
        return sum(request.reserved for request in self.running)

    @property
    def cached_tokens(self) -> int:
        return self.cache.tokens if self.cache is not None else 0

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # --- the rules ----------------------------------------------------------------------

    def _make_room(self) -> list[Request]:
        """Room for every running request's next token: cache entries go first,
        then the requests admitted last; a lone request that outgrew the
        budget fails."""
        ended: list[Request] = []
        while self.held_tokens > self.token_budget:
            if self._evict_one():
                continue
            victim = self.running[-1]
            if len(self.running) == 1:
                self._finish(
                    victim,
                    RequestStatus.FAILED,
                    BudgetExceededError(
                        f"{victim.reserved} tokens do not fit in the model's budget "
                        f"of {self.token_budget}."
                    ),
                )
            else:
                self.stats.preemptions += 1
                self._finish(victim, RequestStatus.PREEMPTED)
            ended.append(victim)
        return ended

    def _admit(self) -> list[Request]:
        ended: list[Request] = []
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            need = len(request.prompt_ids)
            if need > self.token_budget:
                self.waiting.pop(0)
                self._end(
                    request,
                    RequestStatus.FAILED,
                    BudgetExceededError(
                        f"A prompt of {need} tokens does not fit in the model's budget "
                        f"of {self.token_budget}."
                    ),
                )
                ended.append(request)
                continue
            hit = (
                self.cache.lookup(request.prompt_ids, need - 1, request.cache_salt)
                if self.cache is not None and request.cacheable
                else None
            )
            shared = self._computed_by_running(request, need - 1)
            if shared is not None and (hit is None or shared[1] > hit[1]):
                hit = None  # a running request has computed more of it than any entry holds
            else:
                shared = None
            if hit is not None and not self._room_for(need, keep=hit[0]):
                hit = None  # the entry it would copy takes the room it needs: computed whole
            if hit is None and not self._room_for(need):
                break  # in order: a large request is not passed by smaller ones
            self.waiting.pop(0)
            request.status = RequestStatus.PREFILLING
            self.running.append(request)
            tokens = 0
            if hit is not None:
                entry_id, tokens = hit
                assert self.cache is not None
                self.cache.touch(entry_id)
                self._memory_ops.append(Adopt(request.id, entry_id, tokens, need))
            elif shared is not None:
                source, tokens = shared
                self._memory_ops.append(Share(request.id, source.id, tokens, need))
            if tokens:
                request.num_computed = request.cached_tokens = tokens
                self.stats.prefix_hits += 1
                self.stats.prefix_tokens_reused += tokens
        return ended

    def _computed_by_running(self, request: Request, limit: int) -> tuple[Request, int] | None:
        """The running request of ``request``'s salt that has computed the
        longest prefix (at least a cache block, at most ``limit`` tokens) of
        its prompt, and its length; only with the prefix cache (it is the
        same reuse), and neither of them forgotten."""
        if self.cache is None or not request.cacheable:
            return None
        best: tuple[Request, int] | None = None
        for running in self.running:
            if running.cache_salt != request.cache_salt or not running.cacheable:
                continue
            computed = running.token_ids()[: min(running.num_computed, limit)]
            length = _common_prefix(computed, request.prompt_ids)
            if length >= PrefixCache.BLOCK and (best is None or length > best[1]):
                best = (running, length)
        return best

    def _room_for(self, need: int, keep: int | None = None) -> bool:
        """Whether ``need`` more tokens fit, evicting cache entries (all but
        ``keep``) for them; evicts nothing when they would not fit anyway."""
        kept = self.cache.size_of(keep) if self.cache is not None and keep is not None else 0
        evictable = self.cached_tokens - kept
        if self.held_tokens - evictable + need > self.token_budget:
            return False
        while self.held_tokens + need > self.token_budget:
            self._evict_one(keep)
        return True

    def _evict_one(self, keep: int | None = None) -> bool:
        if self.cache is None:
            return False
        entry_id = self.cache.least_recently_used(keep)
        if entry_id is None:
            return False
        self.cache.remove(entry_id)
        self._memory_ops.append(Evict(entry_id))
        return True

    def _finish(
        self, request: Request, status: RequestStatus, error: BaseException | None = None
    ) -> None:
        """A running request ends: what it computed goes to the prefix cache
        under its salt, unless it failed (its memory may be wrong), was
        preempted (its memory is what the others need) or was forgotten."""
        self.running.remove(request)
        entry_id = None
        if self.cache is not None and status not in _NOT_KEPT and request.cacheable:
            entry_id, covered = self.cache.insert(
                request.token_ids()[: request.num_computed], request.cache_salt
            )
            self._memory_ops.append(
                Release(request.id, entry_id, request.num_computed if entry_id else 0)
            )
            self._memory_ops += [Evict(covered_id) for covered_id in covered]
        else:
            self._memory_ops.append(Release(request.id))
        self._end(request, status, error)

    def _end(self, request: Request, status: RequestStatus, error: BaseException | None) -> None:
        request.status = status
        request.error = error
        self._arrival.pop(request.id, None)
        self._requests.pop(request.id, None)


def _common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    """How many tokens ``first`` and ``second`` start with in common."""
    for index, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            return index
    return min(len(first), len(second))
