"""The admin's side of governance: an owner's models and token budgets on its
user page (declared ids only, none ticked: every model; each budget with what
is left), and the models of a token, at its creation and later."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from accounts_app.models import ApiToken
from accounts_app.services import issue_token
from tasks_app.models import DailyUsage, OwnerQuota

from .test_admin import quota_form


@pytest.fixture
def alice(db: None) -> User:
    return User.objects.create_user("alice")


def test_user_page_sets_models_and_budgets_and_shows_what_is_left(
    admin_client: Client, alice: User
) -> None:
    url = reverse("admin:auth_user_change", args=[alice.pk])
    page = admin_client.get(url).content.decode()
    assert 'value="smollm2:135m"' in page and 'value="qwen3:0.6b"' in page  # declared models

    refused = admin_client.post(url, quota_form(alice, allowed_models=["gpt-9"]))
    assert refused.status_code == 200
    assert "Select a valid choice. gpt-9 is not one of the available choices." in (
        refused.content.decode()
    )
    assert not OwnerQuota.objects.filter(owner=alice).exists()

    form = quota_form(
        alice,
        allowed_models=["smollm2:135m"],
        input_tokens_per_day="1000",
        output_tokens_per_month="500",
    )
    answer = admin_client.post(url, form)
    assert answer.status_code == 302, answer.content.decode()[:2000]
    quota = OwnerQuota.objects.get(owner=alice)
    assert quota.allowed_models == ["smollm2:135m"]
    assert (quota.input_tokens_per_day, quota.output_tokens_per_month) == (1000, 500)
    assert quota.output_tokens_per_day is None

    DailyUsage.objects.create(
        owner=alice,
        model="smollm2:135m",
        day=datetime.now(UTC).date(),
        requests=2,
        input_tokens=120,
        output_tokens=30,
    )
    page = admin_client.get(url).content.decode()
    shown = page[page.index('id="lmsp-budgets"') :]
    assert "input tokens this UTC day: 120 used or reserved of 1000, 880 left" in shown
    assert "output tokens this UTC month: 30 used or reserved of 500, 470 left" in shown

    form = quota_form(alice, allowed_models=[])
    form.update({"quota-INITIAL_FORMS": "1", "quota-0-id": str(quota.pk)})
    assert admin_client.post(url, form).status_code == 302
    quota.refresh_from_db()
    assert quota.allowed_models is None  # none ticked: every model
    assert "No budget." in admin_client.get(url).content.decode()


def test_token_models_at_creation_and_later(admin_client: Client, alice: User) -> None:
    answer = admin_client.post(
        "/admin/accounts_app/apitoken/add/",
        {"owner": alice.pk, "name": "narrow", "scopes": ["models:read"], "allowed_models": ["x"]},
    )
    assert "Select a valid choice." in answer.content.decode()
    assert not ApiToken.objects.exists()
    answer = admin_client.post(
        "/admin/accounts_app/apitoken/add/",
        {
            "owner": alice.pk,
            "name": "narrow",
            "scopes": ["models:read"],
            "allowed_models": ["smollm2:135m"],
        },
    )
    assert answer.status_code == 200  # the page that shows the secret once
    assert ApiToken.objects.get(name="narrow").allowed_models == ["smollm2:135m"]

    token = issue_token(owner=alice, scopes=["models:read"], name="wide").token
    assert token.allowed_models is None
    url = f"/admin/accounts_app/apitoken/{token.pk}/change/"
    answer = admin_client.post(url, {"name": "wide", "allowed_models": ["qwen3:0.6b"]})
    assert answer.status_code == 302, answer.content.decode()[:2000]
    token.refresh_from_db()
    assert token.allowed_models == ["qwen3:0.6b"]
