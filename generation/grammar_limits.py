"""Compiling grammars under a time and a memory limit, in a child process.

xgrammar turns a JSON schema into a grammar and a grammar into token masks
in C++: a compile cannot be interrupted from Python, upstream has had
crashes on odd schemas, and some compiles grow quadratically (500 nested
arrays, a 14 kB body, take 17 s here). A client's schema is untrusted input,
so every compile of one runs in a child process: forked from multiprocessing's
fork server (a small process that has xgrammar loaded, so a child starts in
milliseconds), under an address-space limit (``RLIMIT_AS``), and killed when
its time is up. A child that crashes takes nothing else with it.

Both sides use it: the web's check of a request's schemas
(``generation.schemas.schema_problem``) and the worker's compile
(``workers.constraints``), which gets the compiled grammar back serialized.
Importing this module imports nothing heavy: xgrammar is loaded in the fork
server and its children only.

A web process runs a bounded number of these children at once
(``compile_slot``): each may take ``LMSP_GRAMMAR_MEMORY_MB`` and a CPU for
``LMSP_GRAMMAR_TIMEOUT_SECONDS``, and a burst of requests with schemas
would otherwise start one each.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import re
import resource
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# A structural tag format of ours: JSON for a schema without any whitespace
# (see generation.schemas._compact_json), made a grammar format in the child.
COMPACT_JSON = "lmsp_compact_json"

# A child must be up (the fork server imports xgrammar and torch once, several
# seconds on a busy machine) within this; the compile limit starts after it.
STARTUP_SECONDS = 120.0


class GrammarError(Exception):
    """A tag that cannot be compiled: ``index`` says which of those given."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index
        self.reason = reason


class GrammarLimitExceeded(GrammarError):
    """The compile ran out of time or memory (or crashed) in its child."""


class CompilerBusy(Exception):
    """Every compile slot of this process stayed taken for the whole wait."""


@dataclass(frozen=True)
class Limits:
    seconds: float
    memory_mb: int


@functools.cache
def _slots(count: int) -> threading.BoundedSemaphore:
    return threading.BoundedSemaphore(count)


@contextmanager
def compile_slot(count: int, wait: float) -> Iterator[None]:
    """One of this process's ``count`` compile slots, waited for up to
    ``wait`` seconds (``CompilerBusy`` when none came free): compiles beyond
    them wait their turn or are refused, never run all at once."""
    slots = _slots(count)
    if not slots.acquire(timeout=wait):
        raise CompilerBusy(f"{count} grammar compiles already run in this process")
    try:
        yield
    finally:
        slots.release()


@functools.cache
def _context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["xgrammar", __name__])
    return context


def warm() -> None:
    """Start the fork server now (a worker does at start), not at the first schema."""
    compile_tags([], None, Limits(seconds=STARTUP_SECONDS, memory_mb=0))


def _vm_bytes() -> int:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[0])
    return pages * resource.getpagesize()


def _limit_memory(memory_mb: int) -> None:
    """What the child may add to the address space it started with."""
    if memory_mb <= 0:
        return
    limit = _vm_bytes() + memory_mb * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _reason(exc: BaseException) -> str:
    # xgrammar prefixes its messages with a time and a C++ source location.
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
    return text.splitlines()[0] if text else exc.__class__.__name__


def resolve_compact_json(node: object) -> object:
    """A structural tag with our ``COMPACT_JSON`` formats made xgrammar grammars
    (needs xgrammar: runs in the child, or in a process that has it)."""
    import xgrammar as xgr

    if isinstance(node, list):
        return [resolve_compact_json(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == COMPACT_JSON:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(node["json_schema"]), any_whitespace=False, separators=(",", ":")
        )
        return {"type": "grammar", "grammar": str(grammar)}
    return {key: resolve_compact_json(value) for key, value in node.items()}


def _resolved(tag: str) -> str:
    if COMPACT_JSON not in tag:
        return tag
    return json.dumps(resolve_compact_json(json.loads(tag)), ensure_ascii=False)


def _child(conn: Connection, job: dict[str, Any]) -> None:
    """Runs in the child: compile each tag, reporting progress on ``conn``."""
    import xgrammar as xgr

    _limit_memory(job["memory_mb"])
    try:
        if job["kind"] == "tokenizer_info":
            conn.send(("ready", None))
            conn.send(("done", _tokenizer_info(job["folder"])))
            return
        compiler = None
        if job["tokenizer_info"] is not None:
            info = xgr.TokenizerInfo.deserialize_json(job["tokenizer_info"])
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        conn.send(("ready", None))
        results: list[str | None] = []
        for index, tag in enumerate(job["tags"]):
            conn.send(("start", index))
            try:
                tag = _resolved(tag)
                if compiler is None:
                    xgr.Grammar.from_structural_tag(tag)
                    results.append(None)
                else:
                    compiled = compiler.compile_structural_tag(tag)
                    results.append(compiled.serialize_json() if job["keep"] else None)
            except MemoryError:
                conn.send(("memory", index))
                return
            except (RuntimeError, ValueError, TypeError) as exc:
                conn.send(("invalid", (index, _reason(exc))))
                return
        conn.send(("done", results))
    except MemoryError:
        conn.send(("memory", -1))


def _tokenizer_info(folder: str) -> str:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = json.loads((Path(folder) / "config.json").read_text())
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=config.get("vocab_size"))
    serialized: str = info.serialize_json()
    return serialized


def _run(job: dict[str, Any], limits: Limits) -> object:
    """Run ``job`` in a fresh child; its result, or GrammarError/GrammarLimitExceeded."""
    context = _context()
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, job), daemon=True)
    child.start()
    send.close()
    started, index = False, -1
    deadline = time.monotonic() + STARTUP_SECONDS
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not receive.poll(left):
                if not started:
                    raise RuntimeError("The grammar compiler process did not start in time.")
                raise GrammarLimitExceeded(
                    max(index, 0),
                    f"compiling it took longer than the limit of {limits.seconds:g} s",
                )
            try:
                kind, value = receive.recv()
            except EOFError:  # the child died: killed by the kernel, or crashed
                if not started:
                    raise RuntimeError("The grammar compiler process exited at start.") from None
                raise GrammarLimitExceeded(
                    max(index, 0),
                    f"compiling it exceeded the memory limit of {limits.memory_mb} MB "
                    "or crashed the compiler",
                ) from None
            if kind == "ready":
                started = True
                deadline = time.monotonic() + limits.seconds
            elif kind == "start":
                index = value
            elif kind == "done":
                return value
            elif kind == "memory":
                raise GrammarLimitExceeded(
                    max(value, index, 0),
                    f"compiling it exceeded the memory limit of {limits.memory_mb} MB",
                )
            else:  # invalid
                raise GrammarError(*value)
    finally:
        receive.close()
        if child.is_alive():
            child.kill()
        child.join(5)


def compile_tags(
    tags: list[str], tokenizer_info: str | None, limits: Limits, *, keep: bool = False
) -> list[str | None]:
    """Compile structural tags in one child, in order, within ``limits`` in all.

    Without ``tokenizer_info`` only the grammar is built (what needs no
    vocabulary); with it, the token masks too, and ``keep`` returns each
    compiled grammar serialized (``xgrammar.CompiledGrammar.deserialize_json``).
    Raises ``GrammarError`` for a tag xgrammar refuses and
    ``GrammarLimitExceeded`` for one that needs more time or memory (its
    ``index`` names the tag).
    """
    job = {
        "kind": "compile",
        "tags": tags,
        "tokenizer_info": tokenizer_info,
        "keep": keep,
        "memory_mb": limits.memory_mb,
    }
    return _run(job, limits)  # type: ignore[return-value]


@functools.cache
def tokenizer_info(folder: str) -> str:
    """xgrammar's view of the tokenizer in ``folder``, serialized; built once per
    process in a child, so that the web process never loads xgrammar."""
    return _run(  # type: ignore[return-value]
        {"kind": "tokenizer_info", "folder": folder, "memory_mb": 0},
        Limits(seconds=STARTUP_SECONDS, memory_mb=0),
    )
