"""lmsp_client's typed events, without a server: every event type the
service's own builders make survives the trip through SSE text, the SSE
decoder and the parser, whatever way the bytes are cut."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from httpx_sse import EventSource

import lmsp_client
from lmsp_client import events as ev
from lmsp_client._common import GapError, Resume, blocking, real_events, unblocked
from lmsp_client.cli import build_parser, main
from lmsp_client.errors import EventHistoryExpiredError, ProblemError, problem_error
from lmsp_core import protocol
from lmsp_core.errors import problem

RID, MID = "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF", "msg_01J8M6Q4W5C8H2K9P3S7Y1A6ZE"
USAGE = protocol.usage(28, 12)


def built_events() -> list[tuple[str, dict]]:
    """One of each event the protocol defines, made by the service's builders
    (the ``error`` event has no builder: the spec's shape, with a real problem)."""
    message = protocol.message_item(MID, "Hello, world")
    call = protocol.function_call_item(
        "fc_01J8M7B3N8R1S4W7Y0A3E6G9JK", "call_01J8M7B3N9T2V5X8Z1C4D7F0HM", "f", '{"a":1}'
    )
    return [
        protocol.created_event(RID),
        protocol.item_added_event(RID, 0, protocol.reasoning_item("rs_1", None)),
        protocol.reasoning_delta_event(RID, "rs_1", "thinking…"),
        protocol.item_done_event(RID, 0, protocol.reasoning_item("rs_1", "thinking…")),
        protocol.item_added_event(RID, 1, protocol.message_item(MID, None)),
        protocol.text_delta_event(RID, MID, "Hello, "),
        protocol.text_delta_event(RID, MID, 'world\n"quoted" ünïcode'),
        protocol.item_done_event(RID, 1, message),
        protocol.item_added_event(RID, 2, {**call, "arguments": ""}),
        protocol.arguments_delta_event(RID, call["id"], '{"a":1}'),
        protocol.item_done_event(RID, 2, call),
        protocol.completed_event(RID, USAGE),
        protocol.incomplete_event(RID, "max_output_tokens", USAGE),
        protocol.failed_event(RID, problem("generation_failed", "The model crashed.")),
        protocol.cancelled_event(RID, USAGE),
        ("error", {"error": problem("internal_error", "The stream cannot continue.")}),
    ]


EXPECTED_CLASSES = {
    "response.created": lmsp_client.ResponseCreated,
    "response.output_item.added": lmsp_client.OutputItemAdded,
    "response.output_item.done": lmsp_client.OutputItemDone,
    "response.output_text.delta": lmsp_client.OutputTextDelta,
    "response.reasoning_summary_text.delta": lmsp_client.ReasoningSummaryTextDelta,
    "response.function_call_arguments.delta": lmsp_client.FunctionCallArgumentsDelta,
    "response.completed": lmsp_client.ResponseCompleted,
    "response.incomplete": lmsp_client.ResponseIncomplete,
    "response.failed": lmsp_client.ResponseFailed,
    "response.cancelled": lmsp_client.ResponseCancelled,
    "error": lmsp_client.ErrorEvent,
}


def sse_bytes(pairs: list[tuple[str, dict]]) -> bytes:
    frames = [
        protocol.sse_frame(number, name, protocol.dumps(data))
        for number, (name, data) in enumerate(pairs, 1)
    ]
    return protocol.KEEPALIVE_FRAME + protocol.KEEPALIVE_FRAME.join(frames)


def decode(raw: bytes, chunk: int) -> list[lmsp_client.Event]:
    chunks = [raw[i : i + chunk] for i in range(0, len(raw), chunk)]
    response = httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=iter(chunks)
    )
    return list(blocking(real_events(unblocked(EventSource(response).iter_sse()))))


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_every_event_type_round_trips_through_sse(chunk):
    pairs = built_events()
    assert {name for name, _ in pairs} == set(EXPECTED_CLASSES) == set(ev.EVENT_TYPES)
    parsed = decode(sse_bytes(pairs), chunk)
    assert [e.id for e in parsed] == list(range(1, len(pairs) + 1))
    for event, (name, data) in zip(parsed, pairs, strict=True):
        assert type(event) is EXPECTED_CLASSES[name]
        assert event.event_type == name
        assert event.data == data and event.to_data() == data
        for member in type(event).fields:
            assert getattr(event, member) == data[member]
        # the stream ends after a final event or an ``error`` event (section 6.4)
        assert event.is_final == (name in protocol.FINAL_EVENTS or name == "error")
        again = decode(event.to_sse().encode(), chunk)
        assert again == [event] and again[0].data == data


def test_typed_members_read_naturally():
    parsed = decode(sse_bytes(built_events()), 1 << 20)
    deltas = [e for e in parsed if isinstance(e, lmsp_client.OutputTextDelta)]
    assert "".join(d.delta for d in deltas) == 'Hello, world\n"quoted" ünïcode'
    incomplete = next(e for e in parsed if isinstance(e, lmsp_client.ResponseIncomplete))
    assert incomplete.incomplete_details == {"reason": "max_output_tokens"}
    assert incomplete.usage["total_tokens"] == 40
    failed = next(e for e in parsed if isinstance(e, lmsp_client.ResponseFailed))
    assert failed.error["code"] == "generation_failed"
    error = next(e for e in parsed if isinstance(e, lmsp_client.ErrorEvent))
    assert error.error["status"] == 500 and error.is_final


def test_unknown_types_and_extra_members_are_kept():
    unknown = ev.parse_event("response.audio.delta", '{"response_id":"r","delta":"AAA"}', "9")
    assert isinstance(unknown, lmsp_client.UnknownEvent)
    assert unknown.event_type == "response.audio.delta" and unknown.id == 9
    assert unknown.data == {"response_id": "r", "delta": "AAA"} and not unknown.is_final
    assert decode(unknown.to_sse().encode(), 3) == [unknown]
    extra = ev.parse_event(
        "response.completed", '{"response_id":"r","status":"completed","usage":null,"x":1}', "4"
    )
    assert isinstance(extra, lmsp_client.ResponseCompleted) and extra.to_data()["x"] == 1
    # a known type without its required members is kept as received, still final
    broken = ev.parse_event("response.completed", "{}", "5")
    assert isinstance(broken, lmsp_client.UnknownEvent) and broken.is_final
    assert ev.parse_event("", "not json", "").data == {"_text": "not json"}


def test_keepalive_comments_are_not_events():
    raw = b": keep-alive\n\nid: 1\nevent: x\ndata: {}\n\n: keep-alive\n\n: keep-alive\n\n"
    assert [(e.event_type, e.id) for e in decode(raw, 5)] == [("x", 1)]


def test_resume_drops_repeats_and_refuses_gaps():
    state = Resume(2)
    make = lambda n: ev.parse_event("response.output_text.delta", "{}", str(n))  # noqa: E731
    assert not state.accept(make(1)) and not state.accept(make(2))
    assert state.accept(make(3)) and state.last == 3
    assert not state.accept(make(3))
    with pytest.raises(GapError):
        state.accept(make(5))
    assert state.last == 3 and state.headers["Last-Event-ID"] == "3"


def test_problems_become_exceptions_with_their_document():
    document = problem("task_not_found", "No task task_X.", param="task_id")
    error = problem_error(document, 404)
    assert type(error) is ProblemError
    assert (error.status, error.code, error.param) == (404, "task_not_found", "task_id")
    assert error.problem == document and "No task task_X." in str(error)
    expired = problem(
        "event_history_expired",
        "Events up to 7 were removed.",
        first_available_event_id=8,
        task_status="completed",
        task_url="/lmsp/v1/tasks/task_01",
    )
    error = problem_error(expired, 410, after=3)
    assert isinstance(error, EventHistoryExpiredError) and isinstance(error, ProblemError)
    assert (error.first_available_event_id, error.task_status) == (8, "completed")
    assert error.task_url == "/lmsp/v1/tasks/task_01" and error.task_id == "task_01"
    assert "events from 4 to 7" in str(error) and "/lmsp/v1/tasks/task_01" in str(error)


def test_cli_usage_errors_exit_2():
    assert main([]) == 2 and main(["task"]) == 2  # no command given
    for argv in (["nope"], ["task", "follow"], ["ask"], ["task", "list", "--limit", "x"]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2, argv


def test_cli_json_option_is_accepted_before_and_after_the_command():
    parser = build_parser()
    assert parser.parse_args(["--json", "task", "list"]).json is True
    assert parser.parse_args(["task", "list", "--json"]).json is True
    assert parser.parse_args(["task", "list"]).json is False


def test_client_needs_a_token(monkeypatch):
    monkeypatch.delenv("LMSP_TOKEN", raising=False)
    with pytest.raises(lmsp_client.LMSPError):
        lmsp_client.Client("http://127.0.0.1:9")
    monkeypatch.setenv("LMSP_TOKEN", "t")
    monkeypatch.setenv("LMSP_BASE_URL", "http://example.invalid:1/")
    with lmsp_client.Client() as client:
        assert client.base_url == "http://example.invalid:1"


def test_the_sync_client_runs_the_stream_loop_without_an_event_loop():
    """``blocking`` yields what an async generator that never suspends yields,
    closes it when its reader stops early, and refuses one that suspends."""
    closed = []

    async def counting():
        try:
            for n in range(3):
                yield n
        finally:
            closed.append(True)

    assert list(blocking(counting())) == [0, 1, 2] and closed == [True]
    first = blocking(counting())
    assert next(first) == 0
    first.close()
    assert closed == [True, True]

    async def waiting():
        await asyncio.sleep(0)
        yield 1

    with pytest.raises(RuntimeError, match="asynchronous"):
        list(blocking(waiting()))
