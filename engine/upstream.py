"""An engine behind another server: an OpenAI-compatible completions API,
vLLM's token for token, any other's text for text.

Why: a site with a GPU host runs vLLM there, and lmsp keeps what vLLM does
not have in front of it (durable tasks, numbered events, resume, budgets).
This client implements ``engine.interface.EngineClient`` over HTTP, so the
worker runs an upstream model's tasks exactly as its own engine's.

Each request is one streamed ``POST {base_url}/completions`` whose
``prompt`` is token ids (the prompt lmsp rendered, then for a resumed
attempt the tokens generated so far) with ``return_token_ids``: vLLM sends
back the ids it generated, its end token included, so a greedy
continuation is token for token the uninterrupted answer. A constrained
request resumed is asked again from its answer's start instead (vLLM's
grammar cannot start mid-answer), with the same seed: the tokens it gives
again are checked against those generated so far and dropped, and a
difference fails the request rather than splice two answers. A constraint goes
as ``structured_outputs.structural_tag`` (vLLM compiles it with xgrammar,
as lmsp does); the usage chunk (``stream_options.include_usage``) brings the
prompt tokens vLLM took from its prefix cache when it runs with
``--enable-prompt-tokens-details``.

Another OpenAI-compatible server (SGLang, TGI, llama.cpp's, Ollama's) is
asked in text: the engine is given the model's tokenizer (``TextCodec``),
the prompt and the tokens so far go as their text, and the text that comes
back is cut into token ids here, each given out once the text after it can
no longer change it (``_TextTokens``), so that the ids given out spell a
prefix of the server's answer: a continuation goes on from exactly that
text, though the server may tokenize it otherwise than it generated it, and
so answer otherwise than without the interruption. Such a server gets no
grammar (a constrained request is refused at submit) and no ``cache_salt``;
it may share its prefix cache between owners, so the prompt tokens it
reports cached are withheld from a request whose owner is kept apart
(``EngineRequest.cache_salt`` set): they would tell one owner how much of
its prompt another has sent.

``abort`` closes the request's connection: vLLM aborts a request whose
client went away. A request the server cannot take now (refused connection,
timeout, a 5xx or 429) ends ``UNAVAILABLE`` with the reason in ``error``, for
the caller to retry later from its tokens so far; any other 4xx (context too
long, unknown model) ends ``ERROR`` with the server's message. At most
``max_concurrency`` requests are in flight at once; the others wait, lower
``priority`` first.

The API key is given by the caller (read from the environment there) and
kept out of this object's ``repr``. Errors say "the server", never its
address: they reach the task's owner.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import heapq
import itertools
import json
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import aiohttp

from .interface import EngineOutput, EngineRequest, FinishReason, OutputQueue

T = TypeVar("T")
Ending = tuple[FinishReason, str | None, int]  # why, the error's text, cached prompt tokens

# Statuses that mean "not now" rather than "never": the request waits and is retried.
RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
# vLLM's finish reasons: "stop" (an end token or a stop string), "length", and
# "abort", which a request lmsp did not abort gets when the server shuts down:
# not now, rather than never.
FINISH_REASONS = {"stop": FinishReason.EOS, "length": FinishReason.LENGTH}


@dataclass(frozen=True)
class UpstreamServer:
    """Where and how to reach the server for one model."""

    base_url: str  # up to /v1
    model: str  # its served model name
    api_key: str = field(default="", repr=False)
    max_concurrency: int = 8
    connect_timeout: float = 5.0
    read_timeout: float = 120.0


class TextCodec(Protocol):
    """The model's tokenizer, for a server asked in text: ``encode`` adds no
    special token, ``decode`` keeps them (a rendered prompt holds some)."""

    @property
    def eos_token_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class _TextTokens:
    """Token ids for an answer that arrives as pieces of text.

    A tokenizer cuts text into words before it merges their characters into
    tokens, so the text before the last run of whitespace encodes the same
    whatever follows: that is given out, the rest waits for the next piece (in
    a script without spaces, every token but the last, once the text is long).
    Only ids that spell a prefix of the text are given out; the remainder
    comes at the end (as the tokenizer encodes it, where it does not spell it
    back exactly). The model may have generated the text in other tokens than
    the tokenizer gives it, so the server's count of them may be lower: past
    ``max_tokens`` as counted here, nothing more is given out (``full``)."""

    LONGEST_WORD = 64  # characters without whitespace before tokens are given out anyway

    def __init__(self, codec: TextCodec, max_tokens: int) -> None:
        self.codec, self.max_tokens = codec, max_tokens
        self.pending = ""  # the answer's text after the ids given out
        self.given = 0
        self.full = False

    def take(self, piece: str, finish: FinishReason | None) -> tuple[int, ...]:
        """The ids to give out for the next ``piece`` (the last one when
        ``finish`` says why the server ended)."""
        if self.full:
            return ()
        ids = self._add(piece)
        if finish is not None:
            ids += tuple(self.codec.encode(self.pending))
            self.pending = ""
            if finish is FinishReason.EOS:
                ids += (self.codec.eos_token_id,)
        room = self.max_tokens - self.given
        if len(ids) > room or (len(ids) == room and finish is None):
            ids, self.full = ids[:room], True
        self.given += len(ids)
        return ids

    def _add(self, piece: str) -> tuple[int, ...]:
        self.pending += piece
        cut = max(map(self.pending.rfind, " \n\t"))
        while cut > 0 and self.pending[cut - 1].isspace():
            cut -= 1  # a run of whitespace is tokenized with what follows it
        if cut > 0:
            return self._give(self.codec.encode(self.pending[:cut]))
        if len(self.pending) > self.LONGEST_WORD:
            return self._give(self.codec.encode(self.pending)[:-1])
        return ()

    def _give(self, ids: list[int]) -> tuple[int, ...]:
        spelled = self.codec.decode(ids) if ids else ""
        if not spelled or not self.pending.startswith(spelled):
            return ()  # not spelled back: given out at the end
        self.pending = self.pending[len(spelled) :]
        return tuple(ids)


class Unavailable(Exception):
    """The server cannot take a request now (retry later)."""


class Refused(Exception):
    """The server refused the request itself (4xx): retrying will not help."""


class _Stream:
    """One request's outputs (``engine.interface.OutputStream``)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue = OutputQueue()
        self.aborted = threading.Event()
        self.task: asyncio.Task[Ending] | None = None  # its request, on the engine's loop

    def outputs(self, poll: float) -> Iterator[list[EngineOutput]]:
        return self.queue.outputs(poll)

    def hold(self, until: float) -> None:
        self.queue.hold(until)


class UpstreamEngine:
    """``EngineClient`` for one model on one server (see the module's docstring).

    All its requests run on one thread, an asyncio loop. With a thread per
    request, 8 streams' readers, woken together by each step of the server,
    took the interpreter lock from each other several times a token (on a
    machine whose cores a CPU server holds, each such wake-up delays its
    step). Its HTTP client is aiohttp's, whose response parser is compiled:
    a streamed chunk cost httpx's ``aiter_lines`` 166 us of a core, aiohttp
    35 us (8 local streams of 256 chunks of vLLM's shape), and every
    microsecond of it is taken from the server's step beside it."""

    def __init__(self, server: UpstreamServer, text: TextCodec | None = None) -> None:
        """``text``: the model's tokenizer, for a server asked in text rather
        than token ids (any but vLLM)."""
        self.server = server
        self.text = text
        self._loop = asyncio.new_event_loop()
        threading.Thread(
            target=self._loop.run_forever, name=f"upstream-{server.model}", daemon=True
        ).start()
        self._session = self._on_loop(self._new_session()).result()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _closed
        # Places: these three are used on the loop's thread only.
        self._in_flight = 0
        self._order = itertools.count()
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap: priority, arrival
        self._closed = False

    def _on_loop(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(work, self._loop)

    async def _new_session(self) -> aiohttp.ClientSession:
        headers = {"Authorization": f"Bearer {self.server.api_key}"} if self.server.api_key else {}
        return aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=self.server.connect_timeout,
                sock_read=self.server.read_timeout,
            ),
            connector=aiohttp.TCPConnector(limit=self.server.max_concurrency + 2),
            trust_env=True,  # proxies from the environment, as any HTTP client here
        )

    def _url(self, path: str) -> str:
        return self.server.base_url.rstrip("/") + path

    # --- EngineClient ------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> _Stream:
        if not request.prompt_token_ids:
            raise ValueError("A generation needs at least one prompt token.")
        if request.constraint is not None and self.text is not None:
            raise ValueError("This server is asked in text: it cannot follow a grammar.")
        stream = _Stream(request.request_id)
        with self._lock:
            if self._closed:
                raise RuntimeError("The engine is closed.")
            self._streams[request.request_id] = stream
        self._loop.call_soon_threadsafe(self._start, request, stream)
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None:
                return
            stream.aborted.set()
        # Cancelling its task closes its connection: the server sees its
        # client gone and aborts the request.
        self._loop.call_soon_threadsafe(self._cancel, stream)

    # --- health and lifetime -------------------------------------------------------------

    @property
    def running(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        return sum(not turn.done() for _, _, turn in self._waiting)

    def probe(self) -> str | None:
        """None when the server answers ``GET /models`` listing the model,
        else why not. On this object's connections: a client made for each
        probe loaded the certificate store again, tens of milliseconds of a
        core that, beside a CPU engine, its step waited for."""
        return self._on_loop(self._probe()).result()

    async def _probe(self) -> str | None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.server.connect_timeout)
            async with self._session.get(self._url("/models"), timeout=timeout) as answer:
                status, text = answer.status, await answer.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _unreachable(exc)
        if status != 200:
            return f"the server answered {status}: {_message(text)}"
        try:
            served = {model.get("id") for model in json.loads(text).get("data", [])}
        except (ValueError, AttributeError):
            return "the server answered /models with something else than a model list"
        if self.server.model not in served:
            return f"the server does not serve {self.server.model!r}"
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            streams = list(self._streams)
        for request_id in streams:
            self.abort(request_id)
        self._on_loop(self._session.close()).result()

    # --- the requests, on the loop's thread --------------------------------------------------

    def _start(self, request: EngineRequest, stream: _Stream) -> None:
        stream.task = self._loop.create_task(self._run(request, stream))
        # Its last record, however it ended: a task cancelled before its
        # first step never runs a line of its coroutine.
        stream.task.add_done_callback(functools.partial(self._finished, request, stream))

    def _cancel(self, stream: _Stream) -> None:
        if stream.task is not None:
            stream.task.cancel()

    def _finished(
        self, request: EngineRequest, stream: _Stream, task: asyncio.Task[Ending]
    ) -> None:
        finish, error, cached = (
            (FinishReason.CANCELLED, None, 0) if task.cancelled() else task.result()
        )
        if stream.aborted.is_set():
            finish, error = FinishReason.CANCELLED, None
        with self._lock:
            self._streams.pop(request.request_id, None)
        stream.queue.put(EngineOutput(request.request_id, (), finish, cached, error))

    async def _run(self, request: EngineRequest, stream: _Stream) -> Ending:
        """How the request ended: why, the error's text, its cached prompt tokens."""
        finish, error, cached = FinishReason.CANCELLED, None, 0
        try:
            if await self._take_turn(request, stream):
                try:
                    finish, cached = await self._generate(request, stream)
                finally:
                    self._in_flight -= 1
                    self._admit()
        except Unavailable as exc:
            finish, error = FinishReason.UNAVAILABLE, str(exc)
        except Refused as exc:
            finish, error = FinishReason.ERROR, str(exc)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if not stream.aborted.is_set():
                finish, error = FinishReason.UNAVAILABLE, _unreachable(exc)
        except Exception as exc:  # a malformed answer: this request alone fails
            finish, error = FinishReason.ERROR, f"{exc.__class__.__name__}: {exc}"
        return finish, error, cached

    async def _take_turn(self, request: EngineRequest, stream: _Stream) -> bool:
        """Wait for one of ``max_concurrency`` places, lower priority first; False if aborted."""
        if stream.aborted.is_set():
            return False
        turn: asyncio.Future[None] = self._loop.create_future()
        heapq.heappush(self._waiting, (request.priority, next(self._order), turn))
        self._admit()
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # given a place as it was aborted
                self._in_flight -= 1
                self._admit()
            raise
        return True

    def _admit(self) -> None:
        """Give the free places to the waiting requests, lower priority first."""
        while self._waiting and self._in_flight < self.server.max_concurrency:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():  # not aborted meanwhile
                self._in_flight += 1
                turn.set_result(None)

    def _body(self, request: EngineRequest) -> dict[str, Any]:
        sampling = request.sampling
        replayed = _replayed(request)
        prompt = request.prompt_token_ids[: len(request.prompt_token_ids) - replayed]
        body: dict[str, Any] = {
            "model": self.server.model,
            "prompt": list(prompt) if self.text is None else self.text.decode(prompt),
            "max_tokens": sampling.max_tokens + replayed,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if self.text is not None:
            return body  # vLLM's own fields below: another server may refuse them
        body["return_token_ids"] = True
        if request.cache_salt:
            body["cache_salt"] = request.cache_salt
        if request.constraint is not None:
            body["structured_outputs"] = {"structural_tag": request.constraint.structural_tag}
        return body

    async def _generate(self, request: EngineRequest, stream: _Stream) -> tuple[FinishReason, int]:
        finish: FinishReason | None = None
        cached = 0
        # A constrained continuation is asked again from the answer's start:
        # its first tokens must be the ones generated so far, and are dropped.
        expected = request.prompt_token_ids[len(request.prompt_token_ids) - _replayed(request) :]
        replayed: tuple[int, ...] = ()
        # For a server asked in text: its answer cut into token ids.
        tokens = None if self.text is None else _TextTokens(self.text, request.sampling.max_tokens)
        body = self._body(request)
        async with self._session.post(self._url("/completions"), json=body) as response:
            if response.status != 200:
                message = _message(await response.text(errors="replace"))
                if response.status in RETRYABLE_STATUSES:
                    raise Unavailable(f"the server answered {response.status}: {message}")
                raise Refused(message)
            async for line in _lines(response.content):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # an error once streaming has begun
                    raise Unavailable(str(chunk["error"].get("message", chunk["error"])))
                usage = chunk.get("usage") or {}
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                for choice in chunk.get("choices", []):
                    reason = choice.get("finish_reason")
                    if reason and reason not in FINISH_REASONS:
                        raise Unavailable(f"the server ended the request ({reason})")
                    if tokens is not None:
                        ids = tokens.take(choice.get("text") or "", FINISH_REASONS.get(reason))
                    else:
                        ids = tuple(choice.get("token_ids") or ())
                    if len(replayed) < len(expected):
                        taken = len(expected) - len(replayed)
                        replayed, ids = replayed + ids[:taken], ids[taken:]
                        if replayed != expected[: len(replayed)]:
                            raise Refused(
                                f"the server did not give the {len(expected)} tokens generated "
                                "so far again: the constrained answer cannot go on exactly"
                            )
                    if ids and not stream.aborted.is_set():
                        stream.queue.put(EngineOutput(request.request_id, ids))
                    if reason:
                        finish = FINISH_REASONS[reason]
        if stream.aborted.is_set():
            return FinishReason.CANCELLED, cached
        if finish is None:  # the answer stopped short: the server went away
            raise Unavailable("the server ended its answer before it finished")
        if tokens is not None and tokens.full:
            finish = FinishReason.LENGTH  # as counted here, before the server's count
        if tokens is not None and request.cache_salt:
            cached = 0  # its cache may be another owner's (the module's docstring)
        return finish, cached


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The lines of an event stream, without their ends. Split here rather
    than by ``StreamReader.readline``, which refuses a line longer than its
    buffer (64 KiB): vLLM's first chunk holds the prompt's token ids."""
    held: list[bytes] = []  # the pieces of a line whose end has not come
    async for data in content.iter_any():
        *ended, rest = data.split(b"\n")
        if ended:
            ended[0], held = b"".join([*held, ended[0]]), []
        for line in ended:
            yield line.removesuffix(b"\r")
        held.append(rest)
    if last := b"".join(held):
        yield last.removesuffix(b"\r")


def _replayed(request: EngineRequest) -> int:
    """How many of the tokens generated so far are asked again rather than
    sent: all of them for a constrained request (vLLM's grammar starts where
    the request's prompt ends, and cannot be given a state), none otherwise."""
    return request.resumed_tokens if request.constraint is not None else 0


def _message(text: str) -> str:
    """The server's own message of an error answer (OpenAI's ``error.message``)."""
    try:
        error = json.loads(text).get("error", {})
        return str(error.get("message") or text)[:2000]
    except (ValueError, AttributeError):
        return text[:2000]


def _unreachable(exc: Exception) -> str:
    return f"the server is unreachable ({exc.__class__.__name__})"
