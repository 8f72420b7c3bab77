"""Usage on the real stack: requests of two owners through both APIs (a
stored LMSP response, an LMSP task, an OpenAI chat completion, an OpenAI
response), then the usage table (DailyUsage through the selector), the
command's CSV and the admin's pages in Chromium (screenshots in
test-artifacts/screenshots/) and their downloaded CSV equal the sums of the
requests' own ``usage`` objects, and their count."""

from __future__ import annotations

import csv
import io
import time
from collections import Counter
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.utils import timezone
from playwright import sync_api

from ops_app import usage_report
from tasks_app.models import OwnerQuota

from .conftest import make_token, request_body, user_message
from .test_browser import CHROMIUM, CHROMIUM_ARGS, PASSWORD, SCREENSHOTS, shot

pytestmark = pytest.mark.e2e

MODEL = "smollm2:135m"


def finished_task(client, task_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        task = client.get(f"/lmsp/v1/tasks/{task_id}").json()
        if task["result"] is not None:
            return task
        assert time.monotonic() < deadline, task
        time.sleep(0.2)


def alice_requests(api) -> list[dict]:
    """A stored LMSP response and an LMSP task: their usage objects."""
    stored = api.post("/lmsp/v1/responses", json=request_body(store=True, max_output_tokens=8))
    assert stored.status_code == 200, stored.text
    created = api.post(
        "/lmsp/v1/tasks",
        json={"type": "response", "request": request_body("Name a colour.", max_output_tokens=6)},
    )
    assert created.status_code == 202, created.text
    task = finished_task(api, created.json()["id"])
    return [stored.json()["usage"], task["result"]["usage"]]


def bob_requests(bob) -> list[dict]:
    """An OpenAI chat completion and an OpenAI response, as LMSP's usage."""
    chat = bob.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 6},
    )
    assert chat.status_code == 200, chat.text
    answer = bob.post(
        "/v1/responses",
        json={"model": MODEL, "input": [user_message("Count to three.")], "max_output_tokens": 7},
    )
    assert answer.status_code == 200, answer.text
    spent = chat.json()["usage"]
    return [
        {"input_tokens": spent["prompt_tokens"], "output_tokens": spent["completion_tokens"]},
        answer.json()["usage"],
    ]


def expected(usages: list[dict]) -> Counter:
    return Counter(
        requests=len(usages),
        input_tokens=sum(u["input_tokens"] for u in usages),
        output_tokens=sum(u["output_tokens"] for u in usages),
    )


def csv_sums(text: str) -> dict[str, Counter]:
    """Per owner: requests, input and output tokens of a usage CSV."""
    sums: dict[str, Counter] = {}
    for row in csv.DictReader(io.StringIO(text)):
        assert row["model"] == MODEL
        sums.setdefault(row["owner"], Counter()).update(
            {name: int(row[name]) for name in ("requests", "input_tokens", "output_tokens")}
        )
    return sums


def test_usage_tables_equal_the_sums_of_the_requests_usage(stack, api, transactional_db):
    with stack.client(make_token("bob")) as bob:
        want = {"alice": expected(alice_requests(api)), "bob": expected(bob_requests(bob))}
    today = timezone.now().date().isoformat()
    filters = usage_report.filters_from({"from": today, "to": today})
    got: dict[str, Counter] = {}
    for row in usage_report.report(filters).rows:
        got.setdefault(row.owner, Counter()).update(
            requests=row.requests, input_tokens=row.input_tokens, output_tokens=row.output_tokens
        )
    assert got == want
    out = io.StringIO()
    call_command("lmsp_usage", "--from", today, "--to", today, "--format", "csv", stdout=out)
    assert csv_sums(out.getvalue()) == want

    alice = get_user_model().objects.get(username="alice")
    # Her page shows her models and her budget with what her requests left of it.
    OwnerQuota.objects.update_or_create(
        owner=alice, defaults={"allowed_models": [MODEL], "output_tokens_per_day": 1_000}
    )
    get_user_model().objects.create_superuser("root", password=PASSWORD)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900}, accept_downloads=True)
            page.set_default_timeout(30_000)
            downloaded = walk_through_usage(page, stack.base_url, alice.pk, want)
        finally:
            browser.close()
    assert csv_sums(downloaded["service"]) == want
    assert csv_sums(downloaded["alice"]) == {"alice": want["alice"]}


def walk_through_usage(page, base: str, alice_id: int, want: dict[str, Counter]) -> dict:
    """Log in, open the service's usage page from the index and alice's from
    her user page; download each page's CSV. Returns the CSVs' text."""
    expect = sync_api.expect
    page.goto(f"{base}/admin/login/")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.click("#content-main a:text-is('Usage')")
    expect(page.locator("svg.lmsp-chart")).to_have_count(1)
    totals = page.locator("#usage-totals td.n")
    requests = sum(w["requests"] for w in want.values())
    expect(totals.nth(0)).to_have_text(str(requests))
    expect(totals.nth(1)).to_have_text(str(sum(w["input_tokens"] for w in want.values())))
    expect(totals.nth(2)).to_have_text(str(sum(w["output_tokens"] for w in want.values())))
    shot(page, "11-usage-service")
    downloaded = {"service": csv_download(page)}

    page.goto(f"{base}/admin/auth/user/{alice_id}/change/")
    spent = want["alice"]["output_tokens"]
    expect(page.locator(f"input[name='quota-0-allowed_models'][value='{MODEL}']")).to_be_checked()
    expect(page.locator("body")).to_contain_text(
        f"output tokens this UTC day: {spent} used or reserved of 1000, {1_000 - spent} left"
    )
    shot(page, "13-owner-models-and-budgets")
    page.click("#lmsp-usage-link")
    expect(page.locator("h1")).to_contain_text("Usage of alice")
    expect(page.locator("#usage-table tbody tr[data-owner='bob']")).to_have_count(0)
    expect(page.locator("#usage-totals td.n").nth(0)).to_have_text(str(want["alice"]["requests"]))
    shot(page, "12-usage-owner")
    downloaded["alice"] = csv_download(page)
    return downloaded


def csv_download(page) -> str:
    with page.expect_download() as download_info:
        page.click("#usage-csv")
    return Path(download_info.value.path()).read_text()
