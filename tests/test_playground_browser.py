"""The playground (``playground_app``) in a real browser (Debian's Chromium,
driven by Playwright) against the real web process, worker and model: sign
in, send a prompt and see the answer arrive; reload the page mid-answer and
get the task's stored output exactly once; close the tab mid-answer, open
another, and get it again; a second turn goes on from the first; stop
cancels the task; an owner limited to one model sees only it; a used-up
budget is told in a sentence; an admin signs in with the admin's session
from the admin's index. The run writes docs/playground.png, the screenshot
the documentation shows."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model
from playwright import sync_api

from tasks_app.models import OwnerQuota

from .conftest import ALL_SCOPES, LONG_STORY, make_token
from .test_browser import CHROMIUM, CHROMIUM_ARGS, PASSWORD, SCREENSHOTS
from .test_governance_e2e import TWO_MODELS, started

pytestmark = pytest.mark.e2e

SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "playground.png"
MODEL = "smollm2:135m"
expect = sync_api.expect


@contextmanager
def chromium() -> Iterator[sync_api.Browser]:
    """The browser. Started after the test's database work: Playwright's sync
    API runs an event loop, inside which Django refuses synchronous queries."""
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


def open_page(context: sync_api.BrowserContext, base: str) -> sync_api.Page:
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(f"{base}/playground/")
    return page


def sign_in(page: sync_api.Page, secret: str) -> None:
    page.fill("#token", secret)
    page.click("#sign-in")
    expect(page.locator("#workspace")).to_be_visible()


def answers(page: sync_api.Page) -> sync_api.Locator:
    return page.locator("#conversation .turn.assistant")


def send(page: sync_api.Page, text: str, max_tokens: int) -> sync_api.Locator:
    """Sends a prompt; the assistant's turn that answers it (with its task)."""
    before = answers(page).count()
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.fill("#prompt", text)
    page.click("#send")
    answer = answers(page).nth(before)
    expect(answer).to_have_attribute("data-task-id", re.compile(r"^task_[0-9A-Z]{26}$"))
    return answer


def ended(answer: sync_api.Locator, statuses: str = "completed|incomplete") -> None:
    pattern = re.compile(f"^({statuses})$")
    expect(answer).to_have_attribute("data-status", pattern, timeout=180_000)


def text_arrives(answer: sync_api.Locator, at_least: int) -> str:
    """Waits until the answer shows ``at_least`` characters; returns its text."""
    text = answer.locator(".text")
    expect(text).to_have_text(re.compile(rf"[\s\S]{{{at_least},}}"), timeout=120_000)
    return text.text_content() or ""


def stored_text(client: httpx.Client, task_id: str) -> tuple[dict, str]:
    """The task (final) and the text of its stored output."""
    task = client.get(f"/lmsp/v1/tasks/{task_id}").json()
    parts = [
        part["text"]
        for item in task["result"]["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    ]
    return task, "".join(parts)


def test_chat_survives_a_reload_and_a_closed_tab(stack, token, api):
    alice = get_user_model().objects.get(username="alice")
    OwnerQuota.objects.update_or_create(owner=alice, defaults={"output_tokens_per_day": 100_000})
    with chromium() as browser:
        chat_reload_and_closed_tab(browser, stack, token, api)


def chat_reload_and_closed_tab(browser: sync_api.Browser, stack, token: str, api) -> None:  # noqa: ANN001
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = open_page(context, stack.base_url)
    sign_in(page, token)
    expect(page.locator("#model option")).to_have_count(1)
    assert page.locator("#model").input_value() == MODEL
    page.fill("#system", "You are a storyteller.")

    # text arrives; a reload mid-answer goes on from where it was
    answer = send(page, LONG_STORY, 160)
    task_id = answer.get_attribute("data-task-id")
    before_reload = text_arrives(answer, 20)
    assert api.get(f"/lmsp/v1/tasks/{task_id}").json()["status"] == "in_progress"
    expect(page.locator("#stop")).to_be_enabled()
    expect(page.locator("#budget")).to_contain_text("output tokens today")
    page.reload()
    answer = answers(page).last
    expect(answer).to_have_attribute("data-task-id", task_id)
    expect(page.locator("#system")).to_have_value("You are a storyteller.")  # kept too
    ended(answer)
    task, stored = stored_text(api, task_id)
    shown = answer.locator(".text").text_content()
    assert shown == stored and shown.startswith(before_reload), (shown, stored)
    expect(page.locator("#usage")).to_contain_text(
        f"{task['result']['usage']['output_tokens']} output tokens"
    )

    # a second turn goes on from the first (previous_response_id)
    second = send(page, "Give the lighthouse keeper a name.", 24)
    ended(second)
    second_task, second_text = stored_text(api, second.get_attribute("data-task-id"))
    assert second_task["result"]["previous_response_id"] == task["response_id"]
    assert second.locator(".text").text_content() == second_text
    page.screenshot(path=str(SCREENSHOT), full_page=True)

    # the tab closed mid-answer and another opened (a new session storage: sign
    # in again): the same answer goes on
    third = send(page, LONG_STORY + " Tell it again, differently.", 120)
    third_id = third.get_attribute("data-task-id")
    text_arrives(third, 10)
    page.close()
    page = open_page(context, stack.base_url)
    expect(page.locator("#signin")).to_be_visible()
    sign_in(page, token)
    third = answers(page).last
    expect(third).to_have_attribute("data-task-id", third_id)
    ended(third)
    third_task, third_text = stored_text(api, third_id)
    assert third.locator(".text").text_content() == third_text
    assert third_task["result"]["previous_response_id"] == second_task["response_id"]
    page.screenshot(path=str(SCREENSHOTS / "playground-01-conversation.png"), full_page=True)
    context.close()


def test_a_lost_connection_goes_on_without_gap_or_repeat(stack, token, api, restart_after):
    """The web process goes away mid-answer (the page's connection is lost, and
    so is every try to reconnect) and comes back: the page's EventSource
    reconnects by itself and the answer goes on."""
    with chromium() as browser:
        context = browser.new_context()
        page = open_page(context, stack.base_url)
        sign_in(page, token)
        answer = send(page, LONG_STORY, 300)
        task_id = answer.get_attribute("data-task-id")
        before = text_arrives(answer, 20)
        assert api.get(f"/lmsp/v1/tasks/{task_id}").json()["status"] == "in_progress"
        stack.web.kill(signal.SIGKILL)  # no goodbye: the connection just breaks
        expect(page.locator("#status")).to_have_text("The connection was lost; reconnecting…")
        stack.web.start()
        ended(answer)
        task, stored = stored_text(api, task_id)
        shown = answer.locator(".text").text_content()
        assert shown == stored and shown.startswith(before), (shown, stored)
        context.close()


def test_stop_cancels_and_a_used_up_budget_is_told(stack, token, api):
    # another owner, with an input budget smaller than any prompt
    spent = make_token("bea", ALL_SCOPES)
    bea = get_user_model().objects.get(username="bea")
    OwnerQuota.objects.create(owner=bea, input_tokens_per_day=1)
    with chromium() as browser:
        stop_and_budget(browser, stack, token, api, spent)


def stop_and_budget(browser: sync_api.Browser, stack, token: str, api, spent: str) -> None:  # noqa: ANN001
    context = browser.new_context()
    page = open_page(context, stack.base_url)
    sign_in(page, token)
    answer = send(page, LONG_STORY, 400)
    task_id = answer.get_attribute("data-task-id")
    text_arrives(answer, 5)
    page.click("#stop")
    ended(answer, "cancelled")
    assert api.get(f"/lmsp/v1/tasks/{task_id}").json()["status"] == "cancelled"
    expect(page.locator("#status")).to_have_text("The answer was stopped.")
    expect(page.locator("#send")).to_be_enabled()

    # a used-up budget: refused, in words
    page.click("#sign-out")
    sign_in(page, spent)
    page.fill("#prompt", "Hello?")
    page.click("#send")
    error = page.locator("#error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("Your token budget is used up.")
    expect(error).to_contain_text("input token budget of the UTC day")
    assert "{" not in (error.text_content() or "")
    assert answers(page).count() == 0
    page.screenshot(path=str(SCREENSHOTS / "playground-02-budget.png"), full_page=True)
    context.close()


@pytest.fixture(scope="module")
def two_models_url(stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second web process of the stack, whose models file declares two ids."""
    models = tmp_path_factory.mktemp("playground") / "models.toml"
    models.write_text(TWO_MODELS)
    yield from started(stack, "web-playground-models", LMSP_MODELS_FILE=str(models))


def test_an_owner_limited_to_one_model_sees_only_it(two_models_url, transactional_db):
    limited = make_token("lena", ALL_SCOPES)
    lena = get_user_model().objects.get(username="lena")
    OwnerQuota.objects.create(owner=lena, allowed_models=[MODEL])
    free = make_token("frank", ALL_SCOPES)
    with chromium() as browser:
        context = browser.new_context()
        models_of(context, two_models_url, free, limited)


def models_of(context: sync_api.BrowserContext, base: str, free: str, limited: str) -> None:
    page = open_page(context, base)
    sign_in(page, free)
    expect(page.locator("#model option")).to_have_count(2)
    page.click("#sign-out")
    sign_in(page, limited)
    options = page.locator("#model option")
    expect(options).to_have_count(1)
    assert options.first.text_content() == MODEL
    expect(page.locator("#who")).to_contain_text("One model is open to you.")


def test_an_admin_signs_in_with_the_session_from_the_admin(stack, transactional_db):
    get_user_model().objects.create_superuser("root", password=PASSWORD)
    with chromium() as browser:
        session_sign_in(browser, stack)


def session_sign_in(browser: sync_api.Browser, stack) -> None:  # noqa: ANN001
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(f"{stack.base_url}/admin/login/?next=/admin/")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.click("#content-main a:text-is('Playground')")
    expect(page).to_have_url(f"{stack.base_url}/playground/")
    page.click("#session-sign-in")
    expect(page.locator("#workspace")).to_be_visible()
    expect(page.locator("#model option")).to_have_count(1)
    # a bearer token for this tab, not the session: it works on the API
    secret = page.evaluate("sessionStorage.getItem('lmsp.playground.token')")
    assert secret.startswith("lmsp_")
    with stack.client(secret) as client:
        assert client.get("/lmsp/v1/models").status_code == 200
    # and nobody signed out of the admin gets one
    anonymous = browser.new_context().new_page()
    anonymous.goto(f"{stack.base_url}/playground/")
    assert anonymous.locator("#session-sign-in").count() == 0
    context.close()
