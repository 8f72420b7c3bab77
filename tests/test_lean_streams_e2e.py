"""Views served outside Django's request handler (``lmsp_core.lean``: follower
streams and direct responses) answer exactly as Django's handler does: every
status those endpoints give, compared byte for byte (the ``date`` header
aside; for generations, their ids, times and keep-alives too) with a web
process that runs them through Django (``LMSP_LEAN_STREAMS=0``), on the same
database and Redis. The other stream, response, body limit and disconnect
tests go through the lean path too: the stack's web process serves it by
default, as ``test_the_service_serves_its_views_lean`` shows."""

from __future__ import annotations

import json
import re
import select
import socket
import time
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from accounts_app.models import ApiToken
from accounts_app.services import revoke_token
from lmsp_core.lean import LeanViews
from lmsp_project.devstack import free_port
from tasks_app.retention import prune_events

from .conftest import make_token, request_body
from .test_metrics import scrape, value
from .test_tasks_e2e import create_task, wait_for

pytestmark = pytest.mark.e2e

# Two streams per token and three per process, in both web processes: the caps
# are compared too.
CAPS = {"LMSP_MAX_STREAMS_PER_TOKEN": "2", "LMSP_MAX_STREAMS_PER_PROCESS": "3"}


def _scope(method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> dict:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "query_string": b"",
        "headers": headers or [],
    }


def test_the_service_serves_its_views_lean():
    """The application the web process runs (the stack's, the Procfile's) answers
    the follower endpoints and direct responses (LMSP's and OpenAI's) itself,
    with or without a body, and hands everything else to Django."""
    from lmsp_project.asgi import application
    from openai_app import views as openai_views
    from responses_app.views import create_response
    from tasks_app.views import task_events

    assert isinstance(application, LeanViews)
    task = "task_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
    found = application._view_of(_scope("GET", f"/lmsp/v1/tasks/{task}/events"))
    assert found is not None and found.func is task_events
    assert found.route == "lmsp/v1/tasks/<str:task_id>/events"
    answer = application._view_of(_scope("GET", "/v1/responses/resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"))
    assert answer is not None and answer.func is openai_views.response_detail
    posted = {
        "/lmsp/v1/responses": create_response,
        "/v1/responses": openai_views.create_response,
        "/v1/chat/completions": openai_views.chat_completions,
    }
    for body in ([(b"content-length", b"3")], [(b"transfer-encoding", b"chunked")]):
        for path, view in posted.items():
            found = application._view_of(_scope("POST", path, body))
            assert found is not None and found.func is view, path
        found = application._view_of(_scope("GET", f"/lmsp/v1/tasks/{task}/events", body))
        assert found is not None and found.func is task_events
    for scope in (
        _scope("POST", f"/lmsp/v1/tasks/{task}/events"),
        _scope("HEAD", f"/lmsp/v1/tasks/{task}/events"),
        _scope("GET", "/lmsp/v1/responses"),
        _scope("GET", "/v1/chat/completions"),
        _scope("POST", "/v1/responses/resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF/cancel"),
        _scope("GET", f"/lmsp/v1/tasks/{task}"),
        _scope("GET", "/lmsp/v1/models"),
        _scope("GET", "/lmsp/v1/nothing/here"),
        {"type": "lifespan"},
    ):
        assert application._view_of(scope) is None, scope


# --- the same answers from both paths -------------------------------------------------


@pytest.fixture(scope="module")
def twins(stack):
    """(lean port, Django port): two more web processes with the same caps."""
    procs = []
    for lean in ("1", "0"):
        port = free_port()
        proc = stack.another_web(port, f"web-lean{lean}", **CAPS, LMSP_LEAN_STREAMS=lean)
        proc.start()
        procs.append((proc, port))
    yield procs[0][1], procs[1][1]
    for proc, _ in procs:
        proc.stop()


def _request(
    port: int, path: str, headers: dict[str, str | bytes], method: str = "GET", body: bytes = b""
) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    lines = [f"{method} {path} HTTP/1.1".encode()]
    for name, text in {"Host": "127.0.0.1", **headers}.items():
        lines.append(name.encode() + b": " + (text if isinstance(text, bytes) else text.encode()))
    sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
    return sock


def _exchange(
    port: int, path: str, headers: dict[str, str | bytes], method: str = "GET", body: bytes = b""
) -> bytes:
    """The whole answer, as bytes on the wire, less its ``date`` line."""
    sock = _request(port, path, {**headers, "Connection": "close"}, method, body)
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"date:")]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _held(port: int, path: str, token: str) -> tuple[socket.socket, bytes, bytes]:
    """A stream held open: the socket, the head of its answer (less its
    ``date`` line) and what came of its body with it."""
    sock = _request(port, path, {"Authorization": f"Bearer {token}"})
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"date:")]
    return sock, b"\r\n".join(lines), body


def _same(
    twins, path: str, headers: dict[str, str | bytes], method: str = "GET", body: bytes = b""
) -> bytes:
    lean, django = (_exchange(port, path, headers, method, body) for port in twins)
    assert lean == django, path
    return lean


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def test_answers_are_byte_for_byte_those_of_django(twins, api, token, stack):
    done = wait_for(api, create_task(api, max_output_tokens=8)["id"])
    events = f"/lmsp/v1/tasks/{done['id']}/events"
    last = done["last_event_id"]
    auth = {"Authorization": f"Bearer {token}"}
    cases = [
        (events, auth, 200),
        (events, {**auth, "Last-Event-ID": "2"}, 200),
        (f"{events}?after=3", {**auth, "Last-Event-ID": "1"}, 200),
        (f"{events}?after={last}", auth, 204),
        (f"{events}?after={last + 5}", auth, 204),
        (f"{events}?after=abc", auth, 400),
        (f"{events}?after=%00", auth, 400),
        (events, {**auth, "Last-Event-ID": "\xb2".encode("latin-1")}, 400),
        (events, {**auth, "Last-Event-ID": "-3"}, 400),
        (events, {}, 401),
        (events, {"Authorization": "Basic abc"}, 401),
        (events, {"Authorization": "Bearer nonsense"}, 401),
        (events, {"Authorization": "Bearer lmsp_abcdefabcdef_x"}, 401),
        (events, {"Authorization": f"Bearer {make_token('mallory')}"}, 404),
        (events, {"Authorization": f"Bearer {make_token('dave', ['models:read'])}"}, 403),
        ("/lmsp/v1/tasks/%00/events", auth, 404),
        ("/lmsp/v1/tasks/task_01J8M6Q4W2T7N5R3V9X1Z8B0DF/events", auth, 404),
        (events, {**auth, "LMSP-Version": "2.0"}, 400),  # refused by the middleware: Django's
        (events, {**auth, "Host": "evil.example"}, 400),
        (events, {**auth, "Cookie": "sessionid=abc; theme=dark"}, 200),
    ]
    for path, headers, status in cases:
        assert _status(_same(twins, path, headers)) == status, (path, headers)
    for method in ("POST", "HEAD", "DELETE"):  # Django's in both (405)
        assert _status(_same(twins, events, auth, method)) == 405


def test_refused_tokens_are_refused_alike(twins, api, token):
    done = wait_for(api, create_task(api, max_output_tokens=2)["id"])
    events = f"/lmsp/v1/tasks/{done['id']}/events"
    User = get_user_model()
    alice = User.objects.get(username="alice")
    for secret_of in ("revoked", "expired", "inactive"):
        secret = make_token("alice")
        prefix = secret.split("_")[1]
        if secret_of == "revoked":
            revoke_token(prefix)
        elif secret_of == "expired":
            ApiToken.objects.filter(prefix=prefix).update(
                expires_at=timezone.now() - timedelta(seconds=1)
            )
        else:
            User.objects.filter(pk=alice.pk).update(is_active=False)
        try:
            raw = _same(twins, events, {"Authorization": f"Bearer {secret}"})
        finally:
            User.objects.filter(pk=alice.pk).update(is_active=True)
        assert _status(raw) == 401 and b'www-authenticate: Bearer realm="lmsp"' in raw, raw
    # a token's use is recorded at most once a minute, by either path
    ApiToken.objects.filter(prefix=token.split("_")[1]).update(last_used_at=None)
    _exchange(twins[0], events, {"Authorization": f"Bearer {token}"})
    assert ApiToken.objects.get(prefix=token.split("_")[1]).last_used_at is not None


def test_expired_history_is_410_alike(twins, api, token):
    done = wait_for(api, create_task(api, max_output_tokens=2)["id"])
    prune_events(older_than=0)
    raw = _same(twins, f"/lmsp/v1/tasks/{done['id']}/events", {"Authorization": f"Bearer {token}"})
    assert _status(raw) == 410 and b'"event_history_expired"' in raw


def test_live_streams_caps_and_keep_alives_alike(twins, api, token, stack, restart_after):
    stack.pause_worker()  # queued: the streams stay open, with keep-alives (1 s here)
    task = create_task(api, max_output_tokens=4)
    path = f"/lmsp/v1/tasks/{task['id']}/events"
    held = {port: [_held(port, path, token) for _ in range(2)] for port in twins}
    refused = {port: _exchange(port, path, {"Authorization": f"Bearer {token}"}) for port in twins}
    lean, django = twins
    assert [head for _, head, _ in held[lean]] == [head for _, head, _ in held[django]]
    assert held[lean][0][1].startswith(b"HTTP/1.1 200 OK")
    assert refused[lean] == refused[django]
    assert _status(refused[lean]) == 503 and b"retry-after: 5" in refused[lean]
    time.sleep(2.5)
    for port in twins:
        for sock, _, body in held[port]:
            body += sock.recv(65536)
            assert b"event: response.created" in body and b": queued 1" in body, body
    # a closed stream gives its place back at once, on both paths
    for port in twins:
        held[port][0][0].close()
    deadline = time.monotonic() + 10
    for port in twins:
        while True:
            sock, head, _ = _held(port, path, token)
            sock.close()
            if head.startswith(b"HTTP/1.1 200"):
                break
            assert time.monotonic() < deadline, "a closed stream kept its place"
            time.sleep(0.1)
        held[port][1][0].close()


def test_openai_background_response_stream_alike(twins, stack, transactional_db):
    secret = make_token("olivia")
    with stack.client(secret) as client:
        started = client.post("/v1/responses", json={**request_body(), "background": True})
        assert started.status_code == 200, started.text
        response_id = started.json()["id"]
        deadline = time.monotonic() + 120
        while client.get(f"/v1/responses/{response_id}").json()["status"] in (
            "queued",
            "in_progress",
        ):
            assert time.monotonic() < deadline
            time.sleep(0.2)
    auth = {"Authorization": f"Bearer {secret}"}
    path = f"/v1/responses/{response_id}"
    for query, status in [
        ("", 200),
        ("?stream=true", 200),
        ("?stream=true&starting_after=3", 200),
        ("?stream=maybe", 400),
        ("?starting_after=3", 400),
    ]:
        assert _status(_same(twins, path + query, auth)) == status, query
    assert _status(_same(twins, path + "?stream=true", {})) == 401
    other = {"Authorization": f"Bearer {make_token('mallory')}"}
    assert _status(_same(twins, path + "?stream=true", other)) == 404


def test_follower_requests_are_counted_in_metrics(twins, api, token, stack):
    metrics = make_token("prometheus", ["metrics:read"])
    done = wait_for(api, create_task(api, max_output_tokens=2)["id"])
    labels = dict(endpoint="lmsp/v1/tasks/<str:task_id>/events", method="GET", status="200")
    before = value(scrape(stack, metrics), "lmsp_http_requests_total", **labels)
    _exchange(twins[0], f"/lmsp/v1/tasks/{done['id']}/events", {"Authorization": f"Bearer {token}"})
    deadline = time.monotonic() + 10
    while value(scrape(stack, metrics), "lmsp_http_requests_total", **labels) < before + 1:
        assert time.monotonic() < deadline, "the lean path's request was not counted"
        time.sleep(0.2)


# --- direct responses: POST /lmsp/v1/responses, /v1/responses, /v1/chat/completions ---

RESPONSES = "/lmsp/v1/responses"
_IDS = re.compile(rb"\b(resp|msg|fc|call|rs|task)_[0-9A-HJKMNP-TV-Z]{26}\b")
_TIMES = re.compile(rb'"(created|created_at|started_at|completed_at)": ?[0-9]+')
_COMMENTS = re.compile(rb"^:[^\n]*\n\n", re.M)


def _posted(body: object, **headers: str) -> tuple[dict[str, str], bytes]:
    """Headers and bytes of a JSON body (any object, or bytes as they are)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return {"Content-Type": "application/json", **headers, "Content-Length": str(len(raw))}, raw


def _generated(raw: bytes) -> bytes:
    """An answer less what differs from one generation to the next: its ids and
    times, and for a stream its chunks' framing and keep-alives (when they come
    depends on the worker's timing)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        parts = []
        while body:
            size, _, body = body.partition(b"\r\n")
            parts.append(body[: int(size, 16)])
            body = body[int(size, 16) + 2 :]
        body = _COMMENTS.sub(b"", b"".join(parts))
    return _TIMES.sub(rb'"\1": 0', _IDS.sub(rb"\1_ID", head + b"\r\n\r\n" + body))


def _same_generations(twins, path: str, generation: dict, auth: dict[str, str]) -> None:
    """Both paths answer ``generation`` alike, synchronous and streamed.

    The prompt is sent once before: the worker's prefix cache then holds it
    for both twins alike, so their usage reports the same cached tokens (the
    first of two identical requests would compute it cold, the second not)."""
    warm_up_headers, warm_up_body = _posted(generation, **auth)
    assert _status(_exchange(twins[1], path, warm_up_headers, "POST", warm_up_body)) == 200
    for stream in (False, True):
        headers, body = _posted({**generation, "stream": stream}, **auth)
        lean, django = (_exchange(port, path, headers, "POST", body) for port in twins)
        assert _status(lean) == 200, lean
        assert _generated(lean) == _generated(django), (path, stream)
        assert (b"content-type: text/event-stream" in lean) is stream, lean


LIMIT = 1_000_000  # LMSP_MAX_BODY_BYTES


def test_direct_responses_are_byte_for_byte_those_of_django(twins, token):
    auth = {"Authorization": f"Bearer {token}"}
    generation = request_body(max_output_tokens=6)
    _same_generations(twins, RESPONSES, generation, auth)
    cases = [
        (*_posted(generation), 401),
        (*_posted(generation, Authorization="Bearer nonsense"), 401),
        (*_posted(generation, Authorization=f"Bearer {make_token('dave', ['models:read'])}"), 403),
        (*_posted(b"{not json", **auth), 400),
        (*_posted({**generation, "temperature": "hot"}, **auth), 400),
        (*_posted({**generation, "model": "no-such-model"}, **auth), 404),
        (*_posted(generation, **auth, **{"Idempotency-Key": "k" * 256}), 400),
        (*_posted(generation, **auth, **{"Content-Type": "text/plain"}), 400),
        ({**auth, "Content-Length": "0"}, b"", 400),
        ({**auth, "Content-Length": str(10 * LIMIT)}, b"", 413),  # before any byte of it
        ({**auth, "Content-Length": "100"}, b'{"model":', 408),  # 4 s on the test stack
        (*_posted(generation, **auth, **{"LMSP-Version": "2.0"}), 400),  # Django's, body and all
        (*_posted(generation, **auth, Host="evil.example"), 400),
    ]
    for headers, body, status in cases:
        assert _status(_same(twins, RESPONSES, headers, "POST", body)) == status, headers
    assert _status(_same(twins, RESPONSES, auth)) == 405  # GET: Django's in both
    chunked = {**auth, "Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    piece = b"x" * 32_768
    assert _status(_same(twins, RESPONSES, chunked, "POST", _chunks(piece, 3))) == 400
    overflow = [_overflowing(port, chunked, piece) for port in twins]
    assert overflow[0] == overflow[1] and _status(overflow[0]) == 413, overflow


OPENAI_GENERATIONS = {
    "/v1/responses": request_body(max_output_tokens=6),
    "/v1/chat/completions": {
        "model": "smollm2:135m",
        "messages": [{"role": "user", "content": "Say hello in one short sentence."}],
        "max_tokens": 6,
        "temperature": 0,
    },
}


@pytest.mark.parametrize("path", OPENAI_GENERATIONS)
def test_openai_generations_are_byte_for_byte_those_of_django(twins, token, path):
    """OpenAI's direct generations, and their errors in OpenAI's shape, the body
    limit's too (``BoundedBody`` shapes its answers under ``/v1/``)."""
    auth = {"Authorization": f"Bearer {token}"}
    generation = OPENAI_GENERATIONS[path]
    _same_generations(twins, path, generation, auth)
    cases = [
        (*_posted(generation), 401),
        (*_posted(b"{not json", **auth), 400),
        (*_posted({**generation, "temperature": "hot"}, **auth), 400),
        ({**auth, "Content-Length": str(10 * LIMIT)}, b"", 413),  # before any byte of it
        (*_posted(generation, **auth, Host="evil.example"), 400),  # Django's, body and all
    ]
    for headers, body, status in cases:
        raw = _same(twins, path, headers, "POST", body)
        assert _status(raw) == status, headers
        error = json.loads(_generated(raw).partition(b"\r\n\r\n")[2])["error"]
        assert set(error) == {"message", "type", "param", "code"}, raw


def _chunks(piece: bytes, count: int) -> bytes:
    """``count`` chunks of ``piece``, and the last one, in chunked transfer coding."""
    return b"%x\r\n%s\r\n" % (len(piece), piece) * count + b"0\r\n\r\n"


def _overflowing(port: int, headers: dict[str, str | bytes], piece: bytes) -> bytes:
    """The answer to chunks of ``piece`` sent until one comes (413 past the
    limit, before the upload ends), less its ``date`` line."""
    sock = _request(port, RESPONSES, {**headers, "Connection": "close"}, "POST")
    raw = b""
    with sock:
        for _ in range(200):
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([sock], [], [], 0.02)[0]:
                break
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"date:")]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body
