"""An upstream server's event stream read whatever the cuts between the
pieces that reach us (``engine.upstream``, which splits the lines itself).

vLLM's first chunk holds the prompt's token ids: over 64 KiB for a long
prompt, past what aiohttp's ``readline`` takes. A real vLLM cannot be made
to cut its stream where a test wants (tests/test_upstream_e2e.py asks it
as it answers), so a server of a few lines here sends an answer of vLLM's
shape in pieces of 1 to 4,096 bytes, across line ends and ``\\r\\n``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Iterator

import pytest

from engine.interface import EngineRequest, FinishReason, SamplingParams
from engine.upstream import UpstreamEngine, UpstreamServer

PROMPT_IDS = list(range(100_000))  # the first line: about 590 KB
ANSWER_IDS = [11, 12, 13, 14]


def answer_stream() -> bytes:
    """A completion of ``ANSWER_IDS`` as vLLM streams it, some lines ending in CRLF."""
    chunks: list[dict] = [
        {"choices": [{"index": 0, "text": "", "token_ids": []}], "prompt_token_ids": PROMPT_IDS}
    ]
    for i, token_id in enumerate(ANSWER_IDS):
        reason = "length" if i == len(ANSWER_IDS) - 1 else None
        choice = {"index": 0, "text": "x", "token_ids": [token_id], "finish_reason": reason}
        chunks.append({"choices": [choice]})
    usage: dict[str, object] = {"prompt_tokens": 3, "completion_tokens": 4}
    usage["prompt_tokens_details"] = {"cached_tokens": 2}
    chunks.append({"choices": [], "usage": usage})
    lines = [f"data: {json.dumps(chunk)}" for chunk in chunks] + ["data: [DONE]"]
    ends = itertools.cycle(["\n\n", "\r\n\r\n"])
    return "".join(line + end for line, end in zip(lines, ends, strict=False)).encode()


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
    body, sizes = answer_stream(), itertools.cycle([1, 7, 4096, 3, 2, 1500])
    start = 0
    while start < len(body):
        end = start + next(sizes)
        writer.write(body[start:end])
        await writer.drain()
        await asyncio.sleep(0)
        start = end
    writer.close()


@pytest.fixture
def server_url() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(answer, "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}/v1"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    server.close()
    loop.run_until_complete(server.wait_closed())
    loop.close()


def test_an_answer_cut_anywhere_gives_its_tokens_its_end_and_its_usage(server_url: str) -> None:
    engine = UpstreamEngine(UpstreamServer(base_url=server_url, model="m"))
    try:
        stream = engine.submit(EngineRequest("r1", (1, 2, 3), SamplingParams(max_tokens=4)))
        records = [record for records in stream.outputs(poll=30) for record in records]
    finally:
        engine.close()
    assert [t for record in records for t in record.new_token_ids] == ANSWER_IDS
    last = records[-1]
    assert (last.finish_reason, last.cached_tokens, last.error) == (FinishReason.LENGTH, 2, None)
