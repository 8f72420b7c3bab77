"""Hostile input answered by the real web process: every malformed field,
header and query parameter is a 400 problem naming it (never a 500), costly
schemas are refused before they are compiled, and the body limit and the
upload timeout act while the body arrives (issue 12, items 1 and 5)."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from tasks_app.models import Task

from .conftest import request_body, user_message
from .test_errors_e2e import assert_problem

pytestmark = pytest.mark.e2e

FAKE_TASK = "task_01J8M6Q4W2T7N5R3V9X1Z8B0DF"


def post_raw(api, path: str, text: str):
    return api.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


def with_member(body: dict, name: str, raw_value: str) -> str:
    """The body as JSON text with one more top-level member written as raw JSON
    (for literals json.dumps cannot write: 1e999, a 5,000-digit number)."""
    text = json.dumps(body)
    return text[:-1] + f', "{name}": {raw_value}}}'


def deep(levels: int, inner: str = "1") -> str:
    return '{"a": ' * levels + inner + "}" * levels


def schema_nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def tool(parameters: dict, name: str = "f") -> dict:
    return {"type": "function", "name": name, "parameters": parameters}


# --- query parameters, headers and ids ---------------------------------------------


@pytest.mark.parametrize(
    "path, param",
    [
        ("/lmsp/v1/tasks?limit=²", "limit"),
        ("/lmsp/v1/tasks?limit=" + "9" * 5000, "limit"),
        ("/lmsp/v1/tasks?limit=-1", "limit"),
        ("/lmsp/v1/tasks?after=%00", "after"),
        ("/lmsp/v1/tasks?after=task_x", "after"),
        ("/lmsp/v1/tasks?status=%00", "status"),
        (f"/lmsp/v1/tasks/{FAKE_TASK}/events?after=²", "after"),
        (f"/lmsp/v1/tasks/{FAKE_TASK}/events?after=" + "1" * 5000, "after"),
        (f"/lmsp/v1/tasks/{FAKE_TASK}/events?after=%00", "after"),
    ],
)
def test_query_parameters(api, path, param):
    assert_problem(api.get(path), 400, "invalid_request", param)


def test_headers_and_path_ids(api):
    events = f"/lmsp/v1/tasks/{FAKE_TASK}/events"
    for value in ("²".encode("latin-1"), b"1" * 5000, b"-3"):
        answer = api.get(events, headers={"Last-Event-ID": value})
        assert_problem(answer, 400, "invalid_request", "Last-Event-ID")
    answer = api.post(
        "/lmsp/v1/responses",
        json=request_body(),
        headers={"Idempotency-Key": "é".encode("latin-1")},
    )
    assert_problem(answer, 400, "invalid_request", "Idempotency-Key")
    for path in ("/lmsp/v1/responses", "/lmsp/v1/tasks"):
        answer = api.post(path, content=b"{}", headers={"Content-Type": "text/plain"})
        assert_problem(answer, 400, "invalid_request", "Content-Type")
    assert_problem(api.get("/lmsp/v1/tasks/task_%00"), 404, "task_not_found")
    assert_problem(api.get("/lmsp/v1/tasks/%00/events"), 404, "task_not_found")
    assert_problem(api.post("/lmsp/v1/tasks/task_%00/cancel"), 404, "task_not_found")
    assert_problem(api.get("/lmsp/v1/responses/resp_%00"), 404, "response_not_found")
    assert_problem(api.get("/lmsp/v1/models/%00"), 404, "model_not_found")


# --- bodies ------------------------------------------------------------------------


def item_with(**change: object) -> dict:
    return {**user_message("hi"), **change}


def part_with(**change: object) -> dict:
    return {**user_message("hi"), "content": [{"type": "input_text", "text": "hi", **change}]}


@pytest.mark.parametrize(
    "change, param",
    [
        ({"input": [item_with(type=["message"])]}, "input[0].type"),
        ({"input": [item_with(type={"a": 1})]}, "input[0].type"),
        ({"input": [item_with(type=None)]}, "input[0].type"),
        ({"input": [part_with(type=["input_text"])]}, "input[0].content[0].type"),
        ({"input": [part_with(type={"input_text": 1})]}, "input[0].content[0].type"),
        ({"input": [user_message("nul \x00 here")]}, "input[0].content[0].text"),
        ({"input": [part_with(annotations=["\x00"])]}, "input[0].content[0].annotations[0]"),
        ({"model": "smollm2\x00"}, "model"),
        ({"extensions": {"k\x00": 1}}, "extensions"),
        (
            {"tools": [tool({"type": "object", "description": "\x00"})]},
            "tools[0].parameters.description",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "enum": ["a\x00"]}},
                }
            },
            "response_format.json_schema.schema.enum[0]",
        ),
        ({"input": [user_message("x")] * 1001}, "input"),
        (
            {
                "input": [
                    {**user_message("x"), "content": [{"type": "input_text", "text": "x"}] * 101}
                ]
            },
            "input[0].content",
        ),
        ({"tools": [tool({"type": "object"}, f"t{i}") for i in range(129)]}, "tools"),
        ({"tools": [{"type": "function", "name": "a\nb"}]}, "tools[0].name"),
    ],
)
def test_bad_members_are_named(api, change, param):
    answer = api.post("/lmsp/v1/responses", json={**request_body(), **change})
    assert_problem(answer, 400, "invalid_request", param)


@pytest.mark.parametrize(
    "name, raw, param",
    [
        ("extensions", '{"a": [1, {"b": 1e999}]}', "extensions.a[1].b"),
        ("temperature", "-1e999", "temperature"),
        ("max_output_tokens", "1" * 5000, "max_output_tokens"),
        ("extensions", '{"n": ' + "1" * 5000 + "}", "extensions.n"),
        ("extensions", '{"n": 0.' + "1" * 5000 + "}", "extensions.n"),
        ("max_output_tokens", "99999999999999999999999", "max_output_tokens"),
        ("extensions", '{"n": NaN}', "extensions.n"),
        ("extensions", '{"s": "\\ud800"}', "extensions.s"),
        ("extensions", '{"s": "\\u0000"}', "extensions.s"),
    ],
)
def test_numbers_and_escapes(api, name, raw, param):
    body = request_body()
    body.pop(name, None)
    answer = post_raw(api, "/lmsp/v1/responses", with_member(body, name, raw))
    assert_problem(answer, 400, "invalid_request", param)


def test_nesting_3000_deep(api):
    text = with_member(request_body(), "extensions", deep(3000))
    problem = assert_problem(post_raw(api, "/lmsp/v1/responses", text), 400, "invalid_request")
    assert problem["param"].startswith("extensions.a.a.a")
    arrays = with_member(request_body(), "extensions", '{"x": ' + "[" * 3000 + "]" * 3000 + "}")
    problem = assert_problem(post_raw(api, "/lmsp/v1/responses", arrays), 400, "invalid_request")
    assert problem["param"].startswith("extensions.x[0][0]")
    unbalanced = '{"model": "smollm2:135m", "input": ' + "[" * 3000
    assert_problem(post_raw(api, "/lmsp/v1/responses", unbalanced), 400, "invalid_request", "body")
    task = json.dumps({"type": "response", "request": request_body()})
    task = task[:-2] + ', "extensions": ' + deep(3000) + "}}"
    problem = assert_problem(post_raw(api, "/lmsp/v1/tasks", task), 400, "invalid_request")
    assert problem["param"].startswith("request.extensions.a.a")


def test_tasks_name_members_inside_the_request(api):
    raw = json.dumps({"type": "response", "request": request_body()})
    raw = raw[:-2] + ', "temperature": 1e999}}'
    raw = raw.replace('"temperature": 0, ', "")
    assert_problem(
        post_raw(api, "/lmsp/v1/tasks", raw), 400, "invalid_request", "request.temperature"
    )
    body = {"type": "response", "request": request_body(input=[part_with(type=["x"])])}
    answer = api.post("/lmsp/v1/tasks", json=body)
    assert_problem(answer, 400, "invalid_request", "request.input[0].content[0].type")
    body = {"type": ["response"], "request": request_body()}
    assert_problem(api.post("/lmsp/v1/tasks", json=body), 400, "invalid_request", "type")


def test_costly_schemas_are_refused_at_once(api):
    started = time.monotonic()
    for parameters, param in [
        (schema_nested(200), "tools[0].parameters"),  # 9.4 s to compile before
        (schema_nested(20), "tools[0].parameters"),  # 41 deep: over LMSP_MAX_SCHEMA_DEPTH
        ({"type": "string", "pattern": "a{10000}"}, "tools[0].parameters"),  # 19 s
        ({"type": "string", "pattern": "(a{100}){100}"}, "tools[0].parameters"),
        ({"type": "object", "description": "x" * 70_000}, "tools[0].parameters"),
    ]:
        body = request_body(tools=[tool(parameters)], tool_choice="required")
        answer = api.post("/lmsp/v1/responses", json=body)
        problem = assert_problem(answer, 400, "invalid_request")
        assert problem["param"].startswith(param), problem
    assert time.monotonic() - started < 15
    fine = {"type": "object", "properties": {"day": {"type": "string", "pattern": r"\d{4}-\d{2}"}}}
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema_nested(8)}}
    for body in (request_body(tools=[tool(fine)]), request_body(response_format=schema)):
        body["max_output_tokens"] = 1
        assert api.post("/lmsp/v1/responses", json=body).status_code == 200


def test_context_length_is_checked_before_compiling(api):
    """A request too long for the model is refused as such, before its schema
    is compiled (this schema cannot be compiled at all)."""
    bad_schema = {"type": "frobnicate"}
    body = request_body("lorem ipsum " * 5000, tools=[tool(bad_schema)])
    assert_problem(
        api.post("/lmsp/v1/responses", json=body), 400, "context_length_exceeded", "input"
    )
    body = request_body(tools=[tool(bad_schema)])
    assert_problem(
        api.post("/lmsp/v1/responses", json=body), 400, "invalid_request", "tools[0].parameters"
    )
    assert not Task.objects.exists()


# --- the body limit and the upload timeout, on a raw socket ---------------------------


def _connect(stack) -> socket.socket:
    return socket.create_connection(("127.0.0.1", stack.port), timeout=30)


def _head(stack, token: str, extra: str) -> bytes:
    return (
        f"POST /lmsp/v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n{extra}\r\n"
    ).encode()


def _read_answer(sock: socket.socket, wait: float) -> tuple[int, dict, dict]:
    sock.settimeout(wait)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(rest) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    return int(lines[0].split()[1]), headers, json.loads(rest)


def test_body_limit_is_hit_before_the_upload_ends(stack, token):
    limit = 1_000_000  # LMSP_MAX_BODY_BYTES
    chunk = b"x" * 32_768
    planned = 4 * limit
    sent = 0
    answer = None
    started = time.monotonic()
    with _connect(stack) as sock:
        sock.sendall(_head(stack, token, "Transfer-Encoding: chunked\r\n"))
        while sent < planned:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
            readable, _, _ = select.select([sock], [], [], 0.02)
            if readable:
                answer = _read_answer(sock, 10)
                break
        elapsed = time.monotonic() - started
    print(f"413 after {sent} of {planned} bytes sent, {elapsed:.2f} s")
    assert answer is not None, f"no answer while {sent} bytes were sent"
    status, headers, problem = answer
    assert status == 413 and problem["code"] == "payload_too_large"
    assert headers["content-type"] == "application/problem+json"
    assert headers["lmsp-version"] == "1.0"
    assert limit < sent < planned / 2

    with _connect(stack) as sock:  # a declared length over the limit: before any byte of it
        sock.sendall(_head(stack, token, f"Content-Length: {10 * limit}\r\n"))
        status, _, problem = _read_answer(sock, 10)
    assert status == 413 and problem["code"] == "payload_too_large"


def test_a_stalled_upload_times_out(stack, token):
    body = json.dumps(request_body()).encode()
    with _connect(stack) as sock:
        sock.sendall(_head(stack, token, f"Content-Length: {len(body)}\r\n"))
        sock.sendall(body[:10])  # and nothing more
        started = time.monotonic()
        status, headers, problem = _read_answer(sock, 30)
        waited = time.monotonic() - started
    assert status == 408 and problem["code"] == "request_timeout", problem
    assert headers["content-type"] == "application/problem+json"
    assert 3 < waited < 15  # LMSP_BODY_TIMEOUT_SECONDS is 4 on the test stack
    with _connect(stack) as sock:  # a body sent in pieces within the time is fine
        sock.sendall(_head(stack, token, f"Content-Length: {len(body)}\r\n"))
        for start in range(0, len(body), 40):
            sock.sendall(body[start : start + 40])
            time.sleep(0.05)
        status, _, answer = _read_answer(sock, 120)
    assert status == 200 and answer["object"] == "response", answer
