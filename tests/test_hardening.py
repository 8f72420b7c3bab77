"""Hardening as plain functions, without Celery: the sweeper against a real
Redis broker, a removed model, idempotency claims, tokens, the secret key
guard, grammar limits, the job deadline and cut-short tool calls."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from ipaddress import ip_network

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client, override_settings
from django.utils import timezone

from accounts_app.models import ApiToken
from accounts_app.services import authenticate_bearer, create_token, require_scope, revoke_token
from generation import grammar_limits, schemas
from generation.output import TOOL_OPEN, OutputAssembler
from generation.params import GenerationParams
from generation.registry import get_model
from lmsp_core.errors import ProblemError
from lmsp_core.jsonbody import loads_strict
from lmsp_core.rows import as_record, from_row, inserted_columns
from lmsp_core.status import Status
from responses_app.models import Response
from responses_app.serializers import validate_response_request
from responses_app.submit import submit
from tasks_app import claims, sweeper
from tasks_app.event_reader import TOKEN_FIELDS
from tasks_app.models import IdempotencyKey, Task, TaskKind, UsageRecord
from workers.runner import run_task

from .conftest import request_body
from .stack import ROOT
from .test_lifecycle import events_of, new_task

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE_PREFIX = "lmsp.test-hardening"


@pytest.fixture(autouse=True)
def private_queue(settings) -> None:
    """A queue no worker of the test stack serves: only these tests touch it."""
    settings.LMSP_QUEUE_PREFIX = QUEUE_PREFIX


def age(task: Task, seconds: float = 3600) -> None:
    Task.objects.filter(id=task.id).update(enqueued_at=timezone.now() - timedelta(seconds=seconds))


# --- the sweeper -----------------------------------------------------------------


def test_the_sweeper_resends_only_messages_gone_from_the_broker(broker):
    client, queue = broker
    task = new_task()
    assert client.llen(queue) == 1  # sent on commit
    age(task)
    report = sweeper.sweep()
    assert report.resent == [] and client.llen(queue) == 1  # waiting, not lost
    client.delete(queue)  # Redis lost it
    age(task)
    assert sweeper.sweep().resent == [task.id]
    assert client.llen(queue) == 1
    assert Task.objects.get(id=task.id).enqueued_at > timezone.now() - timedelta(minutes=1)
    assert sweeper.sweep().resent == []  # not again before it is stale once more


# A worker as kombu runs one: it takes a message without acknowledging it
# (``acks_late``) and is killed before its claim.
TAKE_A_MESSAGE = """
import sys, time
from kombu import Connection
with Connection(sys.argv[1], transport="lmsp_core.redis_transport:Transport") as broker:
    message = broker.default_channel.basic_get(sys.argv[2])
    print(message.delivery_tag, flush=True)
    time.sleep(600)
"""


@pytest.mark.model
def test_a_message_taken_by_a_worker_killed_before_its_claim_is_sent_again(broker, settings):
    client, queue = broker
    settings.LMSP_REQUEUE_AFTER_SECONDS = 2
    task = new_task()
    taker = subprocess.Popen(
        [sys.executable, "-c", TAKE_A_MESSAGE, settings.CELERY_BROKER_URL, queue],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    tag = taker.stdout.readline().strip()
    taker.kill()  # SIGKILL: kombu restores nothing; the message waits in "unacked" for hours
    taker.wait()
    try:
        assert client.llen(queue) == 0 and client.hexists("unacked", tag)
        age(task)
        assert sweeper.sweep().resent == []  # just taken: a live worker would be claiming it
        time.sleep(2.5)
        age(task)
        assert sweeper.sweep().resent == [task.id]
        assert client.llen(queue) == 1
        assert run_task(task.id, "w1") in ("completed", "incomplete")
    finally:
        client.hdel("unacked", tag)
        client.zrem("unacked_index", tag)


@pytest.mark.model
def test_a_removed_model_fails_its_tasks_and_the_sweep_goes_on(broker):
    client, queue = broker
    first, other, second = new_task(), new_task(), new_task()
    Task.objects.filter(id__in=[first.id, second.id]).update(model="removed:1b")
    # the claim takes the fairest of the model's tasks, whichever its message names
    running = claims.claim(second.id, "w1")
    gone = second if running.id == first.id else first
    Task.objects.filter(id=running.id).update(lease_expires_at=timezone.now() - timedelta(1))
    for task in (gone, other):
        age(task)
    client.delete(queue)  # every message lost
    report = sweeper.sweep()
    assert sorted(report.failed) == sorted([gone.id, running.id])
    assert report.resent == [other.id] and report.errors == []
    for task in (gone, running):
        task.refresh_from_db()
        assert task.status == Status.FAILED
        assert task.error["code"] == "generation_failed" and task.error["model"] == "removed:1b"
        assert "removed:1b" in task.error["detail"]
        assert task.response.status == "failed" and task.response.error == task.error
        assert events_of(task)[-1][1] == "response.failed"
    # the other model's task still runs
    assert run_task(other.id, "w2") in ("completed", "incomplete")


@pytest.mark.model
def test_a_worker_fails_a_claimed_task_whose_model_is_gone():
    task = new_task()
    Task.objects.filter(id=task.id).update(model="removed:1b")
    assert run_task(task.id, "w1") == "failed"
    task.refresh_from_db()
    assert task.error["code"] == "generation_failed" and "removed:1b" in task.error["detail"]


# --- idempotency claims -------------------------------------------------------------


def keyed_submit(owner, key: str) -> Task:  # noqa: ANN001
    request = validate_response_request(request_body())
    return submit(owner, request, kind=TaskKind.TASK, idempotency_key=key, allowed_models=None)


def test_a_claim_whose_request_died_is_taken_over(settings):
    settings.LMSP_IDEMPOTENCY_TAKEOVER_SECONDS = 5
    owner, _ = get_user_model().objects.get_or_create(username="alice")
    stuck = IdempotencyKey.objects.create(owner=owner, key="k1", fingerprint="from-a-dead-process")
    with pytest.raises(ProblemError) as busy:  # young: its request may still be alive
        keyed_submit(owner, "k1")
    assert busy.value.code == "idempotency_key_reused"
    IdempotencyKey.objects.filter(pk=stuck.pk).update(
        created_at=timezone.now() - timedelta(seconds=6)
    )
    task = keyed_submit(owner, "k1")
    assert task.replayed is False
    assert IdempotencyKey.objects.get(owner=owner, key="k1").task_id == task.id
    again = keyed_submit(owner, "k1")
    assert again.id == task.id and again.replayed is True


def test_a_request_whose_claim_was_taken_over_starts_nothing(settings):
    owner, _ = get_user_model().objects.get_or_create(username="alice")
    request = validate_response_request(request_body())

    def start() -> Task:  # the takeover happens while this request prepares
        IdempotencyKey.objects.filter(owner=owner, key="k2").update(created_at=timezone.now())
        return lifecycle_start()

    def lifecycle_start() -> Task:
        from responses_app.submit import prepare_generation, start_generation

        return start_generation(owner, prepare_generation(owner, request), TaskKind.TASK)

    from tasks_app.idempotency import start_once

    with pytest.raises(ProblemError) as lost:
        start_once(owner, "k2", "print", start)
    assert lost.value.code == "idempotency_key_in_use"
    assert Task.objects.count() == 0  # what it started was rolled back


# --- tokens -------------------------------------------------------------------------


def test_tokens_of_an_inactive_user_are_refused():
    issued = create_token(username="carol", scopes="models:read")
    assert authenticate_bearer(f"Bearer {issued.secret}").id == issued.token.id
    get_user_model().objects.filter(username="carol").update(is_active=False)
    with pytest.raises(ProblemError) as refused:
        authenticate_bearer(f"Bearer {issued.secret}")
    assert refused.value.code == "unauthorized" and "deactivated" in str(refused.value.detail)


def test_a_row_read_in_sql_becomes_the_instance_the_orm_builds():
    """``lmsp_core.rows.from_row`` (the claim's pick) decodes what Django's
    connection reads as the ORM does: JSON comes as a list, not as the text in
    which a scope check would be a substring test."""
    issued = create_token(username="dora", scopes="tasks:read,models:read")
    columns = ", ".join(TOKEN_FIELDS)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {columns} FROM {ApiToken._meta.db_table} WHERE id = %s", [issued.token.id]
        )
        row = cursor.fetchone()
    assert isinstance(row[TOKEN_FIELDS.index("scopes")], str)  # jsonb, as Django reads it
    token = from_row(ApiToken, TOKEN_FIELDS, row)
    assert sorted(token.scopes) == ["models:read", "tasks:read"]
    with pytest.raises(ProblemError) as refused:
        require_scope(token, "tasks:rea")
    assert refused.value.code == "insufficient_scope"


def test_a_row_written_in_sql_is_the_row_the_orm_writes():
    """``lmsp_core.rows.as_record`` (the submit's inserts): each column gets
    the value ``save()`` would give it, defaults applied, JSON as JSON (not a
    string of it), times to the microsecond, an auto key numbered by the
    database."""
    owner = get_user_model().objects.create(username="erin")
    when = timezone.now()

    def usage(response_id: str) -> UsageRecord:
        return UsageRecord(
            response_id=response_id, owner=owner, model="m", kind=TaskKind.DIRECT,
            status=Status.IN_PROGRESS, input_tokens=7, created_at=when,
        )  # fmt: skip

    def response(response_id: str) -> Response:
        return Response(
            id=response_id, owner=owner, model="m", params={"temperature": 0.5, "tools": []},
            input=[{"role": "user", "content": [{"type": "input_text", "text": "é \"q\""}]}],
            created_at=when,
        )  # fmt: skip

    response("resp_orm").save()
    usage("resp_orm").save()
    with connection.cursor() as cursor:
        for obj in (response("resp_sql"), usage("resp_sql")):
            table, columns = obj._meta.db_table, ", ".join(inserted_columns(type(obj)))
            cursor.execute(
                f"INSERT INTO {table} ({columns}) SELECT {columns}"
                f" FROM jsonb_populate_record(NULL::{table}, %s::jsonb)",
                [as_record(obj)],
            )
    for model, key in ((Response, "id"), (UsageRecord, "response_id")):
        by_orm, by_sql = (
            model.objects.filter(**{key: response_id}).values().get()
            for response_id in ("resp_orm", "resp_sql")
        )
        assert by_sql.pop(key) == "resp_sql" and by_orm.pop(key) == "resp_orm"
        if model is UsageRecord:
            assert by_sql.pop("id") > by_orm.pop("id")
        assert by_sql == by_orm


def test_revoke_needs_a_whole_prefix():
    issued = create_token(username="carol", scopes="models:read")
    prefix = issued.token.prefix
    assert revoke_token(prefix[:4]) == 0
    with pytest.raises(CommandError, match="whole"):
        call_command("lmsp_token", "revoke", prefix[:-1])
    assert authenticate_bearer(f"Bearer {issued.secret}")  # still valid
    call_command("lmsp_token", "revoke", prefix)
    with pytest.raises(ProblemError):
        authenticate_bearer(f"Bearer {issued.secret}")


@pytest.mark.parametrize("name", ["=1+1", "bob smith", "a" * 151, "", "eve\n"])
def test_lmsp_token_create_refuses_a_user_name_the_admin_would(name):
    with pytest.raises(CommandError, match="user name"):
        call_command("lmsp_token", "create", "--user", name, "--scopes", "models:read")
    assert not get_user_model().objects.filter(username=name).exists()
    out = io.StringIO()
    call_command(
        "lmsp_token", "create", "--user", "a.b@c+d-e_f", "--scopes", "models:read", stdout=out
    )
    assert (
        authenticate_bearer(f"Bearer {out.getvalue().split()[-1]}").owner.username == "a.b@c+d-e_f"
    )


# --- request bodies -----------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, param",
    [
        # escaped quotes and backslashes before the fault, brackets in strings
        (r'{"a\"[": {"b": [1, "x\\", NaN]}}', 'a"[.b[2]'),
        (r'{"k": "[[[[\\", "n": [0, {"m": 1e999}]}', "n[1].m"),
        (r'{"a": [{"s\u0000": 1}]}', "a[0]"),  # a member name: its object
        (r'{"s": ["\\ud83d", "\ud83d\ude00", "x\ud83d"]}', "s[2]"),
        (r'{"a": {"b": 1}, "c": [[' + "[" * 70 + "]" * 72 + "}", "c" + "[0]" * 63),
    ],
)
def test_a_body_fault_is_named_where_it_is(raw, param):
    """``lmsp_core.jsonbody`` names the member at fault from the raw bytes,
    escapes and brackets inside strings notwithstanding (LMSP_MAX_JSON_DEPTH
    is 64)."""
    with pytest.raises(ProblemError) as refused:
        loads_strict(raw.encode())
    assert refused.value.param == param, refused.value.detail


def test_escapes_that_only_look_unstorable_are_accepted():
    raw = r'{"s": "\\u0000 \ud83d\ude00", "t": "\\\"[{"}'
    assert loads_strict(raw.encode()) == {"s": "\\u0000 \U0001f600", "t": '\\"[{'}


# --- settings -----------------------------------------------------------------------

SETUP = "import django; django.setup(); print('started')"


def django_setup(*drop: str, **env: str) -> subprocess.CompletedProcess:
    dropped = ("LMSP_DEVELOPMENT", "LMSP_SECRET_KEY", *drop)
    clean = {k: v for k, v in os.environ.items() if k not in dropped}
    clean.update(DJANGO_SETTINGS_MODULE="lmsp_project.settings", LMSP_DEBUG="0", **env)
    return subprocess.run(
        [sys.executable, "-c", SETUP], cwd=ROOT, env=clean, capture_output=True, text=True
    )


def test_the_built_in_secret_key_is_refused_outside_development(tmp_path):
    refused = django_setup()
    assert refused.returncode != 0 and "LMSP_SECRET_KEY" in refused.stderr
    assert django_setup(LMSP_DEVELOPMENT="1").stdout.strip() == "started"
    assert django_setup(LMSP_SECRET_KEY="a-long-random-value").stdout.strip() == "started"
    # Without DATABASE_URL a server may still reach a PostgreSQL on the default
    # address: only LMSP_DEVELOPMENT=1 makes a run a development run (issue 29).
    unset = ("DATABASE_URL", "REDIS_URL")
    empty = tmp_path / "empty"
    refused = django_setup(*unset, LMSP_DATA_DIR=str(empty))
    assert refused.returncode != 0 and "LMSP_SECRET_KEY" in refused.stderr
    # ... or the record of a running scripts/serve, which is one, for the
    # commands that join its embedded services with nothing exported
    record = {"DATABASE_URL": "postgresql://x@/lmsp", "REDIS_URL": "redis://x/0"}
    (tmp_path / "services.json").write_text(
        json.dumps({**record, "LMSP_DEVELOPMENT": "1", "pid": os.getpid()})
    )
    assert django_setup(*unset, LMSP_DATA_DIR=str(tmp_path)).stdout.strip() == "started"


POOLED = """
import asyncio, django
django.setup()
from django.conf import settings
from django.db import connection
from lmsp_core.http import db_call

def database():
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_database()")
        return cursor.fetchone()[0]

async def many():
    return await asyncio.gather(*(db_call(database) for _ in range(30)))

names = set(asyncio.run(many()))
pool = connection.pool
assert names == {settings.DATABASES["default"]["NAME"]}, names
assert pool.max_size == 3 and pool.get_stats()["pool_size"] <= pool.max_size
print("pooled")
"""


def test_orm_connections_are_pooled_by_default():
    env = {k: v for k, v in os.environ.items() if k != "LMSP_DB_POOL_SIZE"}
    env["DJANGO_SETTINGS_MODULE"] = "lmsp_project.settings"
    code = (
        "import django; django.setup(); from django.conf import settings; "
        "db = settings.DATABASES['default']; "
        "print(db['OPTIONS']['pool']['max_size'], db['CONN_HEALTH_CHECKS'], db['CONN_MAX_AGE'])"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert ran.stdout.split() == ["20", "True", "0"], ran.stderr


def test_with_a_pool_size_connections_come_from_a_pool_that_db_call_hands_back():
    """ORM connections come from psycopg's pool of LMSP_DB_POOL_SIZE (20 by
    default); 30 concurrent calls share 3 connections."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "lmsp_project.settings"}
    env["LMSP_DB_POOL_SIZE"] = "3"
    ran = subprocess.run(
        [sys.executable, "-c", POOLED], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert ran.stdout.strip() == "pooled", ran.stderr


# --- grammar limits -----------------------------------------------------------------


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.model
def test_a_hostile_schema_is_refused_within_the_time_limit(settings):
    settings.LMSP_GRAMMAR_TIMEOUT_SECONDS = 2
    spec = get_model("smollm2:135m")
    warm = {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_arrays(1)}}
    schemas.schema_problem(GenerationParams(response_format=warm), spec)  # fork server, tokenizer
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_arrays(500)}}
    began = time.monotonic()
    param, detail = schemas.schema_problem(GenerationParams(response_format=fmt), spec)
    assert time.monotonic() - began < 2 + 3
    assert param == "response_format.json_schema.schema" and "longer than the limit" in detail


@pytest.mark.model
def test_a_compile_over_the_memory_limit_is_refused():
    info = grammar_limits.tokenizer_info(
        str(__import__("generation.weights").weights.weights_folder(get_model("smollm2:135m")))
    )
    tag = schemas.structural_tag({"type": "json_schema", "json_schema": nested_arrays(3)})
    with pytest.raises(grammar_limits.GrammarLimitExceeded) as refused:
        grammar_limits.compile_tags([tag], info, grammar_limits.Limits(seconds=30, memory_mb=1))
    assert refused.value.index == 0 and "memory" in refused.value.reason


# --- the job deadline ---------------------------------------------------------------


@pytest.mark.model
def test_a_job_past_its_deadline_ends_incomplete(settings):
    settings.LMSP_MAX_JOB_SECONDS = 0
    task = new_task(max_output_tokens=12)
    assert run_task(task.id, "w1") == "incomplete"
    task.refresh_from_db()
    assert task.response.incomplete_details == {"reason": "max_job_seconds"}
    assert events_of(task)[-1][2]["incomplete_details"] == {"reason": "max_job_seconds"}


# --- tool calls cut short -----------------------------------------------------------


def test_a_call_cut_short_leaves_no_markup_in_the_text():
    for cut in ('<tool_call>\n{"name":"get_weather","arguments":{"ci', "<tool_c"):
        assembler = OutputAssembler("resp_1", parse_tools=True)
        events = assembler.feed("Let me check. " + cut) + assembler.close()
        text = "".join(e[1].get("delta", "") for e in events if e[0].endswith("text.delta"))
        assert TOOL_OPEN[:3] not in text and text.strip() == "Let me check.", cut
        assert [item["type"] for item in assembler.items] == ["message"]


def test_a_call_cut_before_its_closing_tag_is_kept_when_its_json_is_whole():
    assembler = OutputAssembler("resp_1", parse_tools=True)
    assembler.feed('<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool')
    assembler.close()
    [call] = assembler.items
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"city": "Oslo"}


# --- issue 46: debug needs a key, development only when said, proxies only when named ---


def settings_started(env: dict[str, str], *drop: str) -> subprocess.CompletedProcess:
    """Django set up in a fresh process with ``env`` over this one's, less
    ``drop`` and any development or key setting."""
    dropped = ("LMSP_DEVELOPMENT", "LMSP_SECRET_KEY", "LMSP_DEBUG", *drop)
    clean = {k: v for k, v in os.environ.items() if k not in dropped}
    clean.update(DJANGO_SETTINGS_MODULE="lmsp_project.settings", **env)
    return subprocess.run(
        [sys.executable, "-c", SETUP], cwd=ROOT, env=clean, capture_output=True, text=True
    )


def test_debug_alone_does_not_start_with_the_built_in_key():
    refused = settings_started({"LMSP_DEBUG": "1"})
    assert refused.returncode != 0 and "LMSP_SECRET_KEY is not set" in refused.stderr
    keyed = settings_started({"LMSP_DEBUG": "1", "LMSP_SECRET_KEY": "a-long-random-value"})
    assert keyed.stdout.strip() == "started", keyed.stderr
    said = settings_started({"LMSP_DEBUG": "1", "LMSP_DEVELOPMENT": "1"})
    assert said.stdout.strip() == "started", said.stderr


def test_a_stale_services_record_whose_pid_was_reused_is_no_development_run(tmp_path):
    """scripts/serve recorded its services and died; its pid now names a
    process started later: the record says nothing."""
    path = tmp_path / "services.json"
    record = {"DATABASE_URL": "postgresql://x@/lmsp", "REDIS_URL": "redis://x/0"}
    written = time.time() - 30
    later = subprocess.Popen(["sleep", "60"])  # started after the record was written
    try:
        path.write_text(json.dumps({**record, "LMSP_DEVELOPMENT": "1", "pid": later.pid}))
        os.utime(path, (written, written))
        refused = settings_started({"LMSP_DATA_DIR": str(tmp_path)}, "DATABASE_URL", "REDIS_URL")
    finally:
        later.kill()
        later.wait()
    assert refused.returncode != 0 and "LMSP_SECRET_KEY is not set" in refused.stderr
    # the record of a process that is running and wrote it still counts
    path.write_text(json.dumps({**record, "LMSP_DEVELOPMENT": "1", "pid": os.getpid()}))
    joined = settings_started({"LMSP_DATA_DIR": str(tmp_path)}, "DATABASE_URL", "REDIS_URL")
    assert joined.stdout.strip() == "started", joined.stderr


def test_behind_a_tls_proxy_the_proxy_s_addresses_are_needed_and_checked():
    key = {"LMSP_SECRET_KEY": "a-long-random-value", "LMSP_BEHIND_TLS_PROXY": "1"}
    alone = settings_started(key)
    assert alone.returncode != 0 and "needs LMSP_TRUSTED_PROXIES" in alone.stderr
    wrong = settings_started({**key, "LMSP_TRUSTED_PROXIES": "10.0.0.1,proxy.example"})
    assert wrong.returncode != 0 and "'proxy.example' is not an IP address" in wrong.stderr
    named = settings_started({**key, "LMSP_TRUSTED_PROXIES": "10.0.0.1, 172.18.0.0/16, ::1"})
    assert named.stdout.strip() == "started", named.stderr


@pytest.mark.parametrize(
    ("address", "secure"),
    [("203.0.113.9", False), ("127.0.0.1", False), ("10.0.0.5", True), ("172.18.3.4", True)],
)
def test_forwarded_headers_count_only_from_a_trusted_proxy(address, secure):
    """A client that reaches the port itself cannot claim https: no HSTS, and
    the scheme stays http; through the proxy (10.0.0.5, or its network) it can."""
    proxies = [ip_network("10.0.0.5"), ip_network("172.18.0.0/16")]
    forwarded = {
        "HTTP_X_FORWARDED_PROTO": "https",
        "HTTP_X_FORWARDED_FOR": "198.51.100.1",
        "HTTP_FORWARDED": "proto=https",
    }
    with override_settings(
        SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https"),
        SECURE_HSTS_SECONDS=3600,
        LMSP_TRUSTED_PROXIES=proxies,
    ):
        answer = Client().get("/livez", REMOTE_ADDR=address, **forwarded)
        assert answer.wsgi_request.is_secure() is secure
    assert answer.status_code == 200
    assert ("Strict-Transport-Security" in answer) is secure
    kept = {name for name in forwarded if name in answer.wsgi_request.META}
    assert kept == (set(forwarded) if secure else set())
