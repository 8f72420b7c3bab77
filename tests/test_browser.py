"""The admin in a real browser (Debian's Chromium, driven by Playwright)
against the real web process: login, the response list, a conversation,
token creation, the model and dashboard pages. Screenshots go to
test-artifacts/screenshots/ for people to look at."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from playwright import sync_api

from .conftest import request_body, user_message

pytestmark = pytest.mark.e2e

CHROMIUM = os.environ.get("LMSP_CHROMIUM", "/usr/bin/chromium")
SCREENSHOTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "screenshots"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
PASSWORD = "correct horse battery staple"


@pytest.fixture
def conversation(api) -> tuple[str, str]:
    """Two stored turns, the second continuing the first."""
    first = api.post(
        "/lmsp/v1/responses",
        json=request_body("My name is Ada. Say hi.", store=True, max_output_tokens=12),
    )
    assert first.status_code == 200, first.text
    second = api.post(
        "/lmsp/v1/responses",
        json=request_body(store=True, max_output_tokens=12, previous_response_id=first.json()["id"])
        | {"input": [user_message("What is my name?")]},
    )
    assert second.status_code == 200, second.text
    return first.json()["id"], second.json()["id"]


def test_admin_in_chromium(stack, api, conversation):
    first_id, second_id = conversation
    # All database work happens before the browser starts: Playwright's sync
    # API runs an event loop, inside which Django refuses synchronous queries.
    get_user_model().objects.create_superuser("root", password=PASSWORD)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(30_000)
            secret = walk_through_admin(page, stack.base_url, first_id, second_id)
        finally:
            browser.close()

    # the secret shown once is a working bearer token
    with stack.client(secret) as client:
        assert client.get("/lmsp/v1/models").status_code == 200


def shot(page, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def walk_through_admin(page, base: str, first_id: str, second_id: str) -> str:
    expect = sync_api.expect

    page.goto(f"{base}/admin/")
    expect(page).to_have_url(re.compile(r"/admin/login/"))
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    shot(page, "01-login")
    page.click("input[type=submit]")
    expect(page.locator("#content-main")).to_contain_text("Dashboard")
    # the admin's own CSS is served by the web process
    header = page.evaluate("getComputedStyle(document.querySelector('#header')).backgroundColor")
    assert header not in ("", "rgba(0, 0, 0, 0)"), header
    shot(page, "02-index")

    page.click("#content-main a[href='/admin/responses_app/response/']")
    expect(page.locator("#result_list")).to_contain_text(second_id)
    expect(page.locator("#result_list")).to_contain_text(first_id)
    shot(page, "03-response-list")

    page.click(f"#result_list a:text-is('{second_id}')")
    chat = page.locator("#conversation")
    expect(chat).to_contain_text("My name is Ada. Say hi.")
    expect(chat).to_contain_text("What is my name?")
    turns = chat.locator(".lmsp-turn")
    expect(turns).to_have_count(2)
    assert turns.nth(0).get_attribute("data-response-id") == first_id
    assert turns.nth(1).get_attribute("data-response-id") == second_id
    expect(page.locator("#timeline")).to_contain_text("response.created")
    shot(page, "04-conversation")

    page.goto(f"{base}/admin/tasks_app/task/")
    expect(page.locator("#result_list")).to_contain_text("smollm2:135m")
    shot(page, "05-task-list")

    page.goto(f"{base}/admin/accounts_app/apitoken/add/")
    page.select_option("#id_owner", label="alice")
    page.fill("#id_name", "browser-test")
    page.check("input[name=scopes][value='models:read']")
    page.check("input[name=scopes][value='responses:read']")
    page.fill("#id_expires_in_days", "7")
    shot(page, "06-token-form")
    page.click("input[name=_save]")
    secret_box = page.locator("#issued-secret")
    expect(secret_box).to_be_visible()
    secret = secret_box.input_value()
    assert secret.startswith("lmsp_")
    shot(page, "07-token-secret")

    page.goto(f"{base}/admin/accounts_app/apitoken/")
    expect(page.locator("#result_list")).to_contain_text("browser-test")
    assert secret not in page.content()
    shot(page, "08-token-list")

    page.goto(f"{base}/admin/lmsp/models/")
    # the model worker's heartbeat says it serves SmolLM2
    expect(page.locator("tr[data-model='smollm2:135m'] td.served")).to_contain_text("models-")
    shot(page, "09-models")

    page.goto(f"{base}/admin/lmsp/dashboard/")
    expect(page.locator("svg.lmsp-chart")).to_have_count(4)
    expect(page.locator("#requests")).to_contain_text("smollm2:135m")
    shot(page, "10-dashboard")
    return secret
