"""Fair sharing end to end: who a free worker serves next, per-owner quotas and
queue positions, through HTTP on the real stack (one model worker).

Generations are short and greedy (``max_output_tokens`` 4, one prompt), so
every task of these tests costs the same number of output tokens. Where a
test needs tasks to wait, a fifth owner's long generations fill the worker's
batch while the others submit, and are cancelled once they have.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.contrib.auth import get_user_model

from generation.registry import get_model
from tasks_app.models import OwnerQuota, Task

from .conftest import LONG_STORY, make_token, request_body, user_message

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

FINAL = {"completed", "incomplete", "failed", "cancelled"}
TOKENS = 4


def post_task(client, **extra) -> dict:
    body = {"type": "response", "request": request_body(max_output_tokens=TOKENS, **extra)}
    answer = client.post("/lmsp/v1/tasks", json=body)
    assert answer.status_code == 202, answer.text
    return answer.json()


def wait_for(client, task_id: str, statuses=FINAL, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        task = client.get(f"/lmsp/v1/tasks/{task_id}").json()
        if task["status"] in statuses:
            return task
        assert time.monotonic() < deadline, f"task {task_id} still {task['status']}"
        time.sleep(0.1)


class Blocker:
    """Long generations of an owner of their own that fill every batch slot of
    the ``workers`` workers (``max_batch`` each), so that the others' tasks wait."""

    def __init__(self, stack, workers: int = 1) -> None:
        self.client = stack.client(make_token("blocker"))
        request = request_body(input=[user_message(LONG_STORY)], max_output_tokens=400)
        self.tasks = [
            self.client.post("/lmsp/v1/tasks", json={"type": "response", "request": request}).json()
            for _ in range(workers * get_model("smollm2:135m").max_batch)
        ]
        for task in self.tasks:
            wait_for(self.client, task["id"], {"in_progress"} | FINAL)

    def release(self) -> None:
        for task in self.tasks:
            self.client.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
        self.client.close()


def wait_all(client, ids: list[str]) -> None:
    for task_id in ids:
        wait_for(client, task_id)


def test_a_newcomer_is_served_before_a_backlog(stack):
    a, b = stack.client(make_token("owner-a")), stack.client(make_token("owner-b"))
    backlog = [post_task(a)["id"] for _ in range(16)]
    wait_for(a, backlog[0], {"in_progress"} | FINAL)  # the worker serves A alone
    newcomer = post_task(b)
    assert newcomer["queue_position"] == 1  # next, ahead of A's backlog
    b_created = Task.objects.get(id=newcomer["id"]).created_at
    wait_all(a, backlog)
    wait_for(b, newcomer["id"])
    b_started = Task.objects.get(id=newcomer["id"]).started_at
    a_started = dict(Task.objects.filter(id__in=backlog).values_list("id", "started_at"))
    still_waiting = [tid for tid in backlog if a_started[tid] > b_created]
    assert still_waiting, "A's backlog was gone before B came: nothing was tested"
    assert all(b_started < a_started[tid] for tid in still_waiting)
    a.close()
    b.close()


def test_four_owners_of_unequal_demand_get_equal_shares_of_tokens(stack):
    four_owners_get_equal_shares(stack, workers=1)


def test_four_owners_get_equal_shares_across_two_workers(stack):
    """The fair order holds across two workers claiming from one queue."""
    second = stack.another_worker("fair-second")
    second.start()
    try:
        four_owners_get_equal_shares(stack, workers=2)
    finally:
        second.stop()


def four_owners_get_equal_shares(stack, workers: int) -> None:
    demand = {"heavy": 6, "large": 5, "medium": 4, "light": 3}  # light submits last
    clients = {name: stack.client(make_token(name)) for name in demand}
    blocker = Blocker(stack, workers)
    tasks = {name: [post_task(clients[name])["id"] for _ in range(n)] for name, n in demand.items()}
    blocker.release()
    for name, ids in tasks.items():
        wait_all(clients[name], ids)

    owner_of = {tid: name for name, ids in tasks.items() for tid in ids}
    rows = Task.objects.filter(id__in=owner_of).select_related("response")
    runs = sorted((row.started_at, owner_of[row.id], row.response.output_tokens) for row in rows)
    assert {tokens for _, _, tokens in runs} == {TOKENS}  # same cost per task
    # While every owner has work: up to the start of the last task of the
    # owner who asked for least.
    last = max(i for i, (_, name, _) in enumerate(runs) if name == "light")
    served = dict.fromkeys(demand, 0)
    for _, name, tokens in runs[: last + 1]:
        served[name] += tokens
    assert max(served.values()) <= 1.1 * min(served.values()), served
    # ... and it went round: no owner is ever two tasks ahead of another.
    counts = dict.fromkeys(demand, 0)
    for _, name, _ in runs[: last + 1]:
        counts[name] += 1
        assert max(counts.values()) - min(counts.values()) <= 1, counts
    for client in clients.values():
        client.close()


def set_quota(username: str, **limits: int) -> None:
    owner = get_user_model().objects.get(username=username)
    OwnerQuota.objects.update_or_create(owner=owner, defaults=limits)


def submitted_at_once(stack, token: str, count: int) -> tuple[list, list]:
    """``count`` task submits sent together: the answers accepted (202) and the others."""

    def submit(_: int):
        with stack.client(token) as client:
            return client.post(
                "/lmsp/v1/tasks",
                json={"type": "response", "request": request_body(max_output_tokens=TOKENS)},
            )

    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(submit, range(count)))
    accepted = [answer for answer in answers if answer.status_code == 202]
    refused = [answer for answer in answers if answer.status_code != 202]
    return accepted, refused


def test_queued_quota_is_race_free_under_twenty_concurrent_submits(stack):
    token = make_token("eager")
    set_quota("eager", max_queued=5)
    blocker = Blocker(stack)
    accepted, refused = submitted_at_once(stack, token, 20)
    assert len(accepted) == 5
    assert Task.objects.filter(owner__username="eager").count() == 5
    for answer in refused:
        assert answer.status_code == 429
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json()["code"] == "rate_limited"
        assert answer.json()["quota"] == "max_queued"
        assert int(answer.headers["Retry-After"]) >= 1
    blocker.release()
    with stack.client(token) as client:
        wait_all(client, [answer.json()["id"] for answer in accepted])
        again = post_task(client)  # room again
        assert again["status"] == "queued"
        wait_for(client, again["id"])


def test_output_token_quota_answers_429_until_the_minute_has_passed(stack):
    with stack.client(make_token("thrifty")) as client:
        set_quota("thrifty", output_tokens_per_minute=TOKENS)
        first = wait_for(client, post_task(client)["id"])
        assert first["result"]["usage"]["output_tokens"] == TOKENS
        refused = client.post(
            "/lmsp/v1/tasks", json={"type": "response", "request": request_body()}
        )
        assert refused.status_code == 429 and refused.json()["code"] == "rate_limited"
        assert refused.json()["quota"] == "output_tokens_per_minute"
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        direct = client.post("/lmsp/v1/responses", json=request_body())
        assert direct.status_code == 429


def test_fifty_concurrent_submits_are_admitted_only_as_far_as_their_output_fits_the_minute(
    stack,
):
    """The per-minute output quota counts what queued and running requests
    may still be sent (their ``max_output_tokens``), not only what ended:
    of fifty requests at once (none can end meanwhile: the blocker holds the
    worker), those admitted may together be sent no more than the quota."""
    token = make_token("bursty")
    quota = 100
    set_quota("bursty", output_tokens_per_minute=quota)
    blocker = Blocker(stack)
    accepted, refused = submitted_at_once(stack, token, 50)
    reserved = sum(
        Task.objects.filter(id__in=[answer.json()["id"] for answer in accepted]).values_list(
            "cost", flat=True
        )
    )
    assert reserved == len(accepted) * TOKENS
    assert reserved <= quota, f"{len(accepted)} admitted may be sent {reserved} tokens"
    assert len(accepted) == quota // TOKENS  # and nothing refused that fitted
    for answer in refused:
        assert answer.status_code == 429
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json()["code"] == "rate_limited"
        assert answer.json()["quota"] == "output_tokens_per_minute"
        assert answer.json()["limit"] == quota
        assert int(answer.headers["Retry-After"]) >= 1
    blocker.release()
    with stack.client(token) as client:
        wait_all(client, [answer.json()["id"] for answer in accepted])


def queued_comments(raw: str) -> list[int]:
    return [int(line.split()[2]) for line in raw.splitlines() if line.startswith(": queued ")]


def test_queue_positions_are_consistent_and_never_go_up(stack):
    token = make_token("patient")
    a, b = stack.client(token), stack.client(make_token("latecomer"))
    blocker = Blocker(stack)
    mine = [post_task(a) for _ in range(5)]
    assert [task["queue_position"] for task in mine] == [1, 2, 3, 4, 5]
    last = mine[-1]["id"]

    seen: list[int | None] = []

    def follow() -> str:
        with stack.client(token) as reader:
            with reader.stream("GET", f"/lmsp/v1/tasks/{last}/events") as answer:
                return "".join(answer.iter_text())

    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(follow)
        time.sleep(2.5)  # a keep-alive or two (every second in the test stack)
        # A newcomer goes ahead of most of A's waiting tasks, but positions
        # already reported do not go up: the last one stays at 5 or below.
        newcomer = post_task(b)
        assert newcomer["queue_position"] == 2  # behind A's first, the same fair key
        blocker.release()
        while True:
            task = a.get(f"/lmsp/v1/tasks/{last}").json()
            seen.append(task["queue_position"])
            if task["status"] != "queued":
                break
            time.sleep(0.05)
        raw = stream.result(timeout=300)

    assert seen[-1] is None  # running or done: no position
    positions = [p for p in seen if p is not None]
    assert positions == sorted(positions, reverse=True) and all(p <= 5 for p in positions)
    comments = queued_comments(raw)
    assert comments, "no keep-alive while the task waited"
    assert comments == sorted(comments, reverse=True) and comments[0] <= 5
    assert "event: response.created" in raw
    assert any(f"event: response.{status}" in raw for status in ("completed", "incomplete"))
    a.close()
    b.close()
