"""The OpenAPI description at /lmsp/v1/openapi.json holds for the live
service: schemathesis generates requests for every operation, valid and
invalid, and every answer must be a documented status with a documented
content type and body, never a server error; invalid requests must be
refused; every error is a problem document (issue 12, item 8).

Generation is real and slow on a CPU: generated bodies keep whatever
schemathesis chose, except that ``max_output_tokens`` is cut to 2 and a
task that was accepted is cancelled at once, so the run stays within
minutes. The number of requests sent is printed and kept in
``test-artifacts/schemathesis.txt``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import request_body

pytestmark = pytest.mark.e2e

MAX_EXAMPLES = 15  # per operation and generation mode
REPORT = Path(__file__).resolve().parent.parent / "test-artifacts" / "schemathesis.txt"
CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


def cheap(body: object) -> None:
    """Cut a generated request's ``max_output_tokens`` to at most 2 (a
    request that is invalid anyway keeps what it had)."""
    if not isinstance(body, dict):
        return
    target = body.get("request") if "request" in body else body
    if not isinstance(target, dict):
        return
    value = target.get("max_output_tokens")
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 2):
        target["max_output_tokens"] = 2


class Run:
    """Sends cases and checks their answers; counts them per operation."""

    def __init__(self, stack, token: str) -> None:
        self.stack, self.token = stack, token
        self.headers = {"Authorization": f"Bearer {token}"}
        self.counts: dict[str, int] = {}

    def check(self, case) -> None:  # noqa: ANN001
        cheap(case.body)
        label = f"{case.method} {case.operation.path}"
        self.counts[label] = self.counts.get(label, 0) + 1
        answer = case.call(base_url=self.stack.base_url, headers=self.headers, timeout=120)
        case.validate_response(answer, checks=CHECKS, headers=self.headers)
        headers = answer.headers  # lower-case names, lists of values
        assert headers.get("lmsp-version") == ["1.0"], (label, answer.status_code, headers)
        if answer.status_code >= 400:
            assert headers["content-type"] == ["application/problem+json"], answer.text
            problem = answer.json()
            assert problem["status"] == answer.status_code
            assert problem["type"] == f"urn:lmsp:error:{problem['code']}"
        if label == "POST /lmsp/v1/tasks" and answer.status_code == 202:
            # a generated task need not run: keep the worker free
            with self.stack.client(self.token) as client:
                client.post(f"/lmsp/v1/tasks/{answer.json()['id']}/cancel")


def test_the_api_keeps_its_description(stack, token):
    with stack.client("") as client:  # like every endpoint, it needs a token
        client.headers.pop("Authorization")
        assert client.get("/lmsp/v1/openapi.json").status_code == 401
    with stack.client(token) as client:
        served = client.get("/lmsp/v1/openapi.json")
    assert served.status_code == 200 and served.json()["openapi"] == "3.1.0"
    # from_dict: from_url would leave out the description's own operation
    schema = schemathesis.openapi.from_dict(served.json())
    run = Run(stack, token)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert (
        len(operations) == 13
    )  # GET /lmsp/v1/usage and POST .../stream-url since issues 46 and 44
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=MAX_EXAMPLES,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate],
            )
            def generated(case) -> None:  # noqa: ANN001
                run.check(case)

            try:
                generated()
            except Unsatisfiable:
                # nothing to make invalid (no parameters, no body)
                assert mode == GenerationMode.NEGATIVE
    # Valid requests that generation rarely makes (a real model): they are
    # answered, and the answers match the description too.
    by_label = {f"{op.method.upper()} {op.path}": op for op in operations}
    for label, body in [
        ("POST /lmsp/v1/responses", request_body(max_output_tokens=2)),
        ("POST /lmsp/v1/responses", request_body(max_output_tokens=2, stream=True)),
        ("POST /lmsp/v1/tasks", {"type": "response", "request": request_body(max_output_tokens=2)}),
    ]:
        run.check(by_label[label].Case(body=body, media_type="application/json"))

    total = sum(run.counts.values())
    lines = [f"{count:4d}  {label}" for label, count in sorted(run.counts.items())]
    text = f"schemathesis: {total} requests over {len(run.counts)} operations\n" + "\n".join(lines)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(text + "\n")
    print("\n" + text)
    assert len(run.counts) == 13
