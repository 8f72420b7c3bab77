"""Every error of the core service is a problem document with the right status,
answered by the real web process."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from accounts_app.models import ApiToken
from accounts_app.services import revoke_token
from tasks_app.models import Task

from .conftest import make_token, request_body, user_message

pytestmark = pytest.mark.e2e


def assert_problem(answer, status: int, code: str, param: str | None = None) -> dict:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.headers["LMSP-Version"] == "1.0"
    problem = answer.json()
    assert problem["type"] == f"urn:lmsp:error:{code}"
    assert problem["code"] == code and problem["status"] == status
    assert problem["title"] and problem["detail"]
    if param is not None:
        assert problem["param"] == param
    return problem


@pytest.mark.parametrize(
    "change, param",
    [
        ({"stream": "yes"}, "stream"),
        ({"model": 42}, "model"),
        ({"input": "hello"}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "message", "role": "user", "content": "hi"}]}, "input[0].content"),
        ({"input": [{"type": "picture"}]}, "input[0].type"),
        ({"input": [{**user_message("hi"), "name": "x"}]}, "input[0].name"),
        ({"input": [{"type": "message", "role": "robot", "content": []}]}, "input[0].role"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 1.5}, "max_output_tokens"),
        ({"store": 1}, "store"),
        ({"metadata": {}}, "metadata"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_bad_fields_are_named(api, change, param):
    answer = api.post("/lmsp/v1/responses", json={**request_body(), **change})
    assert_problem(answer, 400, "invalid_request", param)


def test_malformed_bodies(api):
    for raw in (
        b"{not json",
        b"",
        b"[1, 2]",
        b'{"model": NaN}',
        '{"a": "\udcff"}'.encode("utf-8", "surrogatepass"),
    ):
        answer = api.post(
            "/lmsp/v1/responses", content=raw, headers={"Content-Type": "application/json"}
        )
        assert_problem(answer, 400, "invalid_request")
    huge = json.dumps(request_body("x" * 1_100_000))
    answer = api.post(
        "/lmsp/v1/responses", content=huge, headers={"Content-Type": "application/json"}
    )
    assert_problem(answer, 413, "payload_too_large")


def test_protocol_level_errors(api):
    answer = api.post("/lmsp/v1/responses", json=request_body(), headers={"LMSP-Version": "2.0"})
    assert_problem(answer, 400, "unsupported_version", "LMSP-Version")
    assert api.get("/lmsp/v1/models", headers={"LMSP-Version": "1.3"}).status_code == 200

    image = {"type": "message", "role": "user", "content": [{"type": "input_image", "text": "x"}]}
    answer = api.post("/lmsp/v1/responses", json=request_body(input=[image]))
    assert_problem(answer, 400, "unsupported_content_type", "input[0].content[0].type")

    answer = api.post("/lmsp/v1/responses", json=request_body("lorem ipsum " * 5000))
    assert_problem(answer, 400, "context_length_exceeded", "input")

    assert_problem(
        api.post("/lmsp/v1/responses", json=request_body(model="gpt-9")),
        404,
        "model_not_found",
        "model",
    )
    assert_problem(api.get("/lmsp/v1/models/gpt-9"), 404, "model_not_found")
    assert_problem(
        api.get("/lmsp/v1/responses/resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"), 404, "response_not_found"
    )
    later = request_body(previous_response_id="resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF")
    assert_problem(
        api.post("/lmsp/v1/responses", json=later),
        404,
        "response_not_found",
        "previous_response_id",
    )
    assert_problem(api.get("/lmsp/v1/tasks/task_01J8M6Q4W2T7N5R3V9X1Z8B0DF"), 404, "task_not_found")
    assert_problem(api.get("/lmsp/v1/elsewhere"), 404, "not_found")

    answer = api.get("/lmsp/v1/responses")
    assert_problem(answer, 405, "method_not_allowed")
    assert answer.headers["Allow"] == "POST"
    answer = api.delete("/lmsp/v1/tasks")
    assert_problem(answer, 405, "method_not_allowed")
    assert "POST" in answer.headers["Allow"] and "GET" in answer.headers["Allow"]
    answer = api.get("/lmsp/v1/models", headers={"Host": "elsewhere.example"})
    assert_problem(answer, 400, "invalid_request")  # Django's own refusal, as a problem
    assert not Task.objects.exists()  # nothing refused was queued


def test_authentication_and_scopes(stack, transactional_db):
    def call(token: str | None, method: str = "GET", path: str = "/lmsp/v1/models", **kw):
        with stack.client(token or "") as client:
            if token is None:
                client.headers.pop("Authorization")
            return client.request(method, path, **kw)

    for token in (None, "nonsense", "lmsp_abc_def"):
        answer = call(token)
        assert_problem(answer, 401, "unauthorized")
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    for path in ("/lmsp/v1/tasks/task_01J8M6Q4W2T7N5R3V9X1Z8B0DF/events", "/lmsp/v1/responses"):
        assert_problem(call(None, "GET" if "events" in path else "POST", path), 401, "unauthorized")

    revoked = make_token("bob")
    revoke_token(revoked.split("_")[1])
    assert_problem(call(revoked), 401, "unauthorized")

    expired = make_token("carol")
    ApiToken.objects.filter(prefix=expired.split("_")[1]).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert_problem(call(expired), 401, "unauthorized")

    reader = make_token("dave", ["models:read"])
    assert call(reader).status_code == 200
    for method, path, scope in [
        ("POST", "/lmsp/v1/responses", "responses:write"),
        ("GET", "/lmsp/v1/responses/resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF", "responses:read"),
        ("POST", "/lmsp/v1/tasks", "tasks:write"),
        ("GET", "/lmsp/v1/tasks", "tasks:read"),
        ("GET", "/lmsp/v1/tasks/task_01J8M6Q4W2T7N5R3V9X1Z8B0DF/events", "tasks:read"),
    ]:
        kwargs = {"json": request_body()} if method == "POST" else {}
        problem = assert_problem(call(reader, method, path, **kwargs), 403, "insufficient_scope")
        assert scope in problem["detail"]
    writer = make_token("erin", ["responses:write"])
    assert_problem(call(writer, "GET", "/lmsp/v1/models"), 403, "insufficient_scope")
